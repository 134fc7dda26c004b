"""What a module imports, read from its source (the fitness tests' one walk)."""

from __future__ import annotations

import ast
from pathlib import Path


def imported_modules(path: Path) -> list[str]:
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import"
            module = node.module or ""
            names.append(module)
            if module == "hlplugin":  # "from hlplugin import cdi" names the module in the alias
                names.extend(f"hlplugin.{alias.name}" for alias in node.names)
    return names
