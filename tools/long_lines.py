"""`python tools/long_lines.py [PATH...]`: the lines of learncb/ and tests/ over 110 characters, as
`file:line: text`.

The one exception is nbdev's own `__all__` statement, which nbdev-export wraps at 120 characters."""
import ast, sys
from pathlib import Path

WIDTH = 110
ROOT = Path(__file__).parent.parent

def all_lines(text):
    "The line numbers of the `__all__ = [...]` statement nbdev writes"
    try: tree = ast.parse(text)
    except SyntaxError: return set()
    return {n for node in tree.body if isinstance(node, ast.Assign)
            and any(getattr(t, 'id', None) == '__all__' for t in node.targets)
            for n in range(node.lineno, node.end_lineno + 1)}

def long_lines(path):
    text = Path(path).read_text()
    skip = all_lines(text)
    return [(i, line) for i,line in enumerate(text.splitlines(), 1) if len(line) > WIDTH and i not in skip]

def python_files(roots=('learncb', 'tests')):
    return sorted(p for r in roots for p in (ROOT/r).rglob('*.py') if p.name != '_modidx.py')

if __name__ == '__main__':
    paths = [Path(p) for p in sys.argv[1:]] or python_files()
    found = [(p, i, l) for p in paths for i,l in long_lines(p)]
    for p,i,l in found: print(f'{p.relative_to(ROOT) if p.is_absolute() else p}:{i}: {l.strip()[:90]}')
    sys.exit(1 if found else 0)
