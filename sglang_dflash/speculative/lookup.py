"""Context lookup proposals: the continuation of the longest suffix n-gram seen earlier in prompt + output.

The index maps each n-gram (min_n <= n <= max_n) to the position of its latest earlier occurrence; it is
updated in O(max_n - min_n + 1) per committed token and never rescans the history.
"""

from __future__ import annotations


class NgramIndex:
    """One request's token history and n-gram index. The last token (the bonus, not in the KV cache yet) is
    the end of the suffix being matched; it is indexed once the next token arrives."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self.last_end: dict[tuple[int, ...], int] = {}  # n-gram -> end position of its latest occurrence
        self.indexed = 0  # positions < indexed are in the index

    def extend(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)
        toks = self.tokens
        for end in range(self.indexed, len(toks) - 1):
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                self.last_end[tuple(toks[end - n + 1 : end + 1])] = end
        self.indexed = max(self.indexed, len(toks) - 1)

    def sync(self, prompt: list[int], output: list[int]) -> None:
        """Catches up with a request's history: prompt + outputs (the bonus last), reading only what is new."""
        seen = len(self.tokens) - len(prompt)
        if seen < 0 or seen > len(output):  # new, or retracted and recomputed: start over
            self.__init__(self.min_n, self.max_n)
            self.extend(prompt + output)
        else:
            self.extend(output[seen:])

    def propose(self, max_tokens: int) -> tuple[list[int], int]:
        """(continuation of the longest matching suffix, at most max_tokens; its n), ([], 0) without a match."""
        toks = self.tokens
        for n in range(min(self.max_n, len(toks) - 1), self.min_n - 1, -1):
            end = self.last_end.get(tuple(toks[len(toks) - n :]))
            if end is not None:
                return toks[end + 1 : end + 1 + max_tokens], n
        return [], 0
