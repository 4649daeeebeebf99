"""Build hook: ship ``sglang_cpu_shims.pth`` at the top of site-packages."""

from __future__ import annotations

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

_PTH = "sglang_cpu_shims.pth"


class BuildPyWithPth(build_py):
    """Copy the .pth file next to the packages so the wheel installs it into site-packages."""

    def run(self) -> None:
        super().run()
        src = Path(__file__).resolve().parent / _PTH
        self.copy_file(str(src), str(Path(self.build_lib) / _PTH))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib) / _PTH)]


setup(cmdclass={"build_py": BuildPyWithPth})
