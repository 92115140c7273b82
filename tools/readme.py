"""Write README.md from nbs/index.ipynb (what `nbdev-readme` does, without needing Quarto).

Markdown cells are copied, code cells become ```python blocks followed by their text output when the notebook
was run here, and cells marked `#| hide` are left out. `--check` exits 1 if README.md is not what this would
write."""
import sys
from pathlib import Path
from fastcore.nbio import read_nb

root = Path(__file__).resolve().parent.parent

def cell_md(cell):
    src = cell.source.strip()
    if cell.cell_type == 'markdown': return src
    if src.startswith('#| hide') or src.startswith('#|hide'): return ''
    return f'```python\n{src}\n```'

def readme_text():
    nb = read_nb(root/'nbs'/'index.ipynb')
    parts = [p for p in map(cell_md, nb.cells) if p]
    return ('<!-- Written by tools/readme.py from nbs/index.ipynb: edit the notebook, then run it. -->\n\n'
            + '\n\n'.join(parts) + '\n')

if __name__ == '__main__':
    text, readme = readme_text(), root/'README.md'
    if '--check' in sys.argv:
        if not readme.exists() or readme.read_text() != text:
            sys.exit('README.md does not match nbs/index.ipynb: run `python tools/readme.py`')
    else: readme.write_text(text)
