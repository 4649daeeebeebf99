"""Deterministic code-writing prompts built from Python standard-library APIs (name + docstring summary)."""

from __future__ import annotations

import importlib
import inspect
import random
import re
from dataclasses import dataclass

# A fixed, side-effect-free module list keeps generation reproducible (no antigravity/this/tkinter).
STDLIB_MODULES = (
    "abc argparse array ast base64 bisect binascii builtins calendar cmath codecs collections colorsys "
    "configparser contextlib copy csv dataclasses datetime decimal difflib email.utils enum filecmp fnmatch "
    "fractions functools glob graphlib gzip hashlib heapq hmac html html.parser http.cookies io ipaddress "
    "itertools json keyword linecache logging math mimetypes operator os os.path pathlib pickle platform "
    "pprint queue quopri random re reprlib secrets shlex shutil socket sqlite3 statistics string struct "
    "subprocess tarfile tempfile textwrap threading time timeit tokenize types typing unicodedata "
    "urllib.parse urllib.request uuid warnings weakref xml.etree.ElementTree zipfile zlib"
).split()
_VERBS = frozenset(
    "return compute convert create make get set add remove find split join read write open close apply "
    "check test build parse format encode decode compress decompress copy move delete raise run call wrap "
    "insert pop push sort count generate load dump replace search match translate update yield construct "
    "calculate determine escape unescape quote unquote normalize register change print send receive".split()
)
_ADDR_REPR = re.compile(r"<(?:function )?([^<>]*?) at 0x[0-9a-fA-F]+>")
_SELF = re.compile(r"^\(self(, /)?(, )?")
_TEMPLATES = {
    "implement": "Implement `{name}{sig}` in pure Python, mimicking `{qual}` without calling it: {doc}",
    "function": "Write a Python function that {clause}",
    "explain": "Explain what `{qual}` does and show a short example of using it.",
    "usage": 'Show how to use `{qual}` in a small, complete Python script. Its documentation says: "{doc}"',
    "tests": 'Write pytest unit tests for `{qual}`, which is documented as: "{doc}" Cover edge cases.',
    "pitfalls": "What are common pitfalls when using `{qual}` in Python? Illustrate with code.",
    "compare": "Compare `{qual}` with `{other}`. When would you use each? Give code examples.",
}


@dataclass(frozen=True)
class Api:
    module: str
    qual: str  # dotted path as a user would write it, e.g. "os.path.join" or "str.split"
    name: str
    sig: str
    doc: str


def _summary(obj: object) -> str:
    doc = inspect.getdoc(obj) or ""
    paras = [p for p in doc.split("\n\n") if p.strip()]
    for para in paras[:2]:
        text = " ".join(para.split())
        if re.match(r"^[\w.]+\(.*\)( -> .*)?$", text):  # legacy C signature line, not a description
            continue
        text = re.split(r"(?<=[.!?])\s", text, maxsplit=1)[0]
        text = text if text.endswith((".", "!", "?")) else text + "."
        return text if 12 <= len(text) <= 240 else ""
    return ""


def _signature(obj: object) -> str:
    try:
        sig = _SELF.sub("(", str(inspect.signature(obj)))
    except (TypeError, ValueError):
        return "(...)"
    # Default-value reprs such as <function f at 0x7f..> would make prompts differ from run to run.
    return _ADDR_REPR.sub(lambda m: m[1] if m[1].isidentifier() else "<default>", sig)


def _members(obj: object, module_name: str) -> list[tuple[str, object]]:
    """Public callables of a module or class, in name order, defined there (not re-exported)."""
    out = []
    for name, member in sorted(vars(obj).items()):
        if name.startswith("_") or not callable(member) or inspect.ismodule(member):
            continue
        if inspect.isclass(member) and issubclass(member, BaseException):
            continue
        owner = getattr(member, "__module__", None) or module_name
        if inspect.ismodule(obj) and owner.lstrip("_") not in (module_name, obj.__name__.lstrip("_")):
            continue
        out.append((name, member))
    return out


def collect_apis(modules: tuple[str, ...] | list[str] = STDLIB_MODULES) -> list[Api]:
    """Documented public functions, classes and class methods of the given modules, in a stable order."""
    apis: list[Api] = []
    for module_name in modules:
        module = importlib.import_module(module_name)
        for name, member in _members(module, module_name):
            prefix = "" if module_name == "builtins" else module_name + "."
            if doc := _summary(member):
                apis.append(Api(module_name, prefix + name, name, _signature(member), doc))
            if inspect.isclass(member):
                for meth_name, meth in _members(member, module_name):
                    if doc := _summary(meth):
                        qual = f"{prefix}{name}.{meth_name}"
                        apis.append(Api(module_name, qual, meth_name, _signature(meth), doc))
    return apis


def _clause(doc: str) -> str | None:
    """'Return the sum of x.' -> 'returns the sum of x.'; None if the summary is not an imperative."""
    first, _, rest = doc.partition(" ")
    verb = first.lower()
    if verb not in _VERBS or not rest:
        return None
    if verb.endswith(("s", "sh", "ch", "x", "z")):
        verb += "es"
    elif verb.endswith("y") and verb[-2:-1] not in "aeiou":
        verb = verb[:-1] + "ies"
    else:
        verb += "s"
    return f"{verb} {rest}"


def code_prompts(apis: list[Api], seed: int, per_api: int = 2) -> list[str]:
    """`per_api` distinct templated prompts per API, chosen with a seeded RNG."""
    rng = random.Random(seed)
    siblings: dict[str, list[str]] = {}  # APIs sharing a parent (module or class) are worth comparing
    for api in apis:
        siblings.setdefault(api.qual.rpartition(".")[0], []).append(api.qual)
    prompts = []
    for api in apis:
        clause = _clause(api.doc)
        others = [q for q in siblings[api.qual.rpartition(".")[0]] if q != api.qual]
        kinds = [k for k in _TEMPLATES if (k != "function" or clause) and (k != "compare" or others)]
        for kind in rng.sample(kinds, min(per_api, len(kinds))):
            other = rng.choice(others) if kind == "compare" else ""
            prompts.append(
                _TEMPLATES[kind].format(
                    name=api.name, sig=api.sig, qual=api.qual, doc=api.doc, clause=clause, other=other
                )
            )
    return prompts
