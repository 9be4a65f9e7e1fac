"""Layout metrics for decode/, distill/ and quickstart/: lines per module, functions over 80 lines, function-local imports of the
project's own modules, import cycles (grimp), docs lines (reference vs results), files in scripts/.

    python dev/layout_metrics.py [--json OUT]
"""
import argparse
import ast
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OWN = ("decode", "distill", "quickstart")
LONG = 80


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def resolve(node: ast.ImportFrom, mod: str, is_pkg: bool) -> str:
    if node.level == 0:
        return node.module or ""
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def scan(path: Path):
    tree = ast.parse(path.read_text(), str(path))
    mod, is_pkg = module_name(path), path.name == "__init__.py"
    long_funcs, local_imports = [], []

    def visit(node, in_func):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = child.end_lineno - child.lineno + 1
                if n > LONG:
                    long_funcs.append((f"{mod}.{child.name}", n))
                visit(child, True)
            elif isinstance(child, (ast.Import, ast.ImportFrom)) and in_func:
                names = ([a.name for a in child.names] if isinstance(child, ast.Import)
                         else [resolve(child, mod, is_pkg)])
                if any(n.split(".")[0] in OWN for n in names):
                    local_imports.append((mod, child.lineno))
            else:
                visit(child, in_func)

    visit(tree, False)
    return len(path.read_text().splitlines()), long_funcs, local_imports


def cycles(package: str):
    import grimp
    graph = grimp.build_graph(package)
    mods = sorted(m for m in graph.modules if m.startswith(package))
    # strongly connected components (Tarjan) over direct imports within the package
    index, low, stack, on, out, i = {}, {}, [], set(), [], [0]

    def strong(v):
        index[v] = low[v] = i[0]; i[0] += 1; stack.append(v); on.add(v)
        for w in graph.find_modules_directly_imported_by(v):
            if not w.startswith(package):
                continue
            if w not in index:
                strong(w); low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop(); on.discard(w); comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for m in mods:
        if m not in index:
            strong(m)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    report = {}
    for pkg in ("decode", "distill", "quickstart"):
        files = sorted((ROOT / pkg).rglob("*.py"))
        per = {}
        longs, locals_ = [], []
        for f in files:
            n, lf, li = scan(f)
            per[str(f.relative_to(ROOT))] = n
            longs += lf
            locals_ += li
        report[pkg] = {"lines": per, "total_lines": sum(per.values()), "max_module": max(per.items(), key=lambda kv: kv[1]),
                       "functions_over_80": sorted(longs, key=lambda x: -x[1]), "function_local_own_imports": len(locals_),
                       "import_cycles": cycles(pkg)}
    docs = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in sorted((ROOT / "docs").rglob("*.md"))}
    report["docs"] = {"reference": sum(v for k, v in docs.items() if "/results/" not in k),
                      "results": sum(v for k, v in docs.items() if "/results/" in k),
                      "README.md": len((ROOT / "README.md").read_text().splitlines())}
    report["scripts_files"] = len([p for p in (ROOT / "scripts").iterdir() if p.is_file()])
    for pkg in ("decode", "distill", "quickstart"):
        r = report[pkg]
        print(f"{pkg}: {len(r['lines'])} modules, {r['total_lines']} lines, largest {r['max_module']}")
        print(f"  functions over {LONG} lines: {len(r['functions_over_80'])} {r['functions_over_80']}")
        print(f"  function-local imports of own modules: {r['function_local_own_imports']}")
        print(f"  import cycles (grimp, strongly connected components): {[len(c) for c in r['import_cycles']]}")
        for c in r["import_cycles"]:
            print("   ", " ".join(c))
    print("docs:", report["docs"], "scripts/ files:", report["scripts_files"])
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
