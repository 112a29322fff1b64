"""Code prompts from the CPython standard library, HumanEval-shaped: a function's signature and
docstring with the body left for the model to write.

Training data for the built-in drafter's code side; HumanEval itself stays held out. Deterministic
(sorted files, seeded shuffle), public-domain-compatible source (the PSF-licensed stdlib shipped
with this Python).

    python recipes/smollm2/make_code_prompts.py OUT.jsonl [--n 3000] [--seed 0]
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import random
import sysconfig
from pathlib import Path

SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "turtledemo", "site-packages", "ensurepip",
             "tkinter", "__pycache__", "pydoc_data", "encodings"}


def function_prompts(path: Path) -> list[tuple[str, str]]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    out = []
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node, clean=True)
        if not doc or len(doc) < 40 or len(doc) > 800:
            continue
        stub = ast.FunctionDef(name=node.name, args=node.args, body=[ast.Expr(ast.Constant(""))],
                               decorator_list=[], returns=node.returns, type_comment=None)
        head = ast.unparse(ast.fix_missing_locations(ast.Module([stub], []))).splitlines()[0]
        body = "\n".join(("    " + line).rstrip() for line in doc.splitlines())
        out.append((f"{path.stem}.{node.name}", f'{head}\n    """\n{body}\n    """\n'))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--n", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    root = Path(sysconfig.get_paths()["stdlib"])
    prompts, seen = [], set()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for name in sorted(filenames):
            if name.endswith(".py"):
                for pid, text in function_prompts(Path(dirpath) / name):
                    if pid not in seen:
                        seen.add(pid)
                        prompts.append((pid, text))
    random.Random(args.seed).shuffle(prompts)
    prompts = prompts[: args.n]
    tmp = Path(args.out + ".tmp")
    with tmp.open("w") as f:
        for pid, text in prompts:
            f.write(json.dumps({"id": f"stdlib-{pid}", "prompt": text}) + "\n")
    tmp.replace(args.out)
    print(f"{len(prompts)} prompts ({len(seen)} functions found) -> {args.out}")


if __name__ == "__main__":
    main()
