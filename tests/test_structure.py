"The package's shape: no import cycle among learncb's modules, and the learner module free of file formats"
import ast
from pathlib import Path
import learncb

PKG = Path(learncb.__file__).parent

def module_name(path):
    return '.'.join(('learncb', *path.relative_to(PKG).with_suffix('').parts)).removesuffix('.__init__')

def imported(path):
    "The learncb modules that `path` imports, at its top or inside functions (`importlib.import_module` too)"
    name, found = module_name(path), set()
    package = name if path.name == '__init__.py' else name.rpartition('.')[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ''
            if node.level:
                parts = package.split('.')[:len(package.split('.')) - node.level + 1]
                base = '.'.join(parts + ([base] if base else []))
            found |= {base} | {f'{base}.{a.name}' for a in node.names}
        elif isinstance(node, ast.Import): found |= {a.name for a in node.names}
        elif (isinstance(node, ast.Call) and getattr(node.func, 'attr', None) == 'import_module' and node.args
              and isinstance(node.args[0], ast.Constant)): found.add(node.args[0].value)
    return found

def import_graph():
    modules = {module_name(p): p for p in PKG.rglob('*.py') if p.name not in ('_modidx.py', 'all.py')}
    return {m: sorted(i for i in imported(p) if i in modules and i != m) for m, p in modules.items()}

def find_cycle(graph):
    "A list of modules that import each other in a circle, or `None`"
    state, stack = {}, []
    def visit(m):
        state[m] = 'open'; stack.append(m)
        for n in graph[m]:
            if state.get(n) == 'open': return stack[stack.index(n):] + [n]
            if n not in state and (cycle := visit(n)): return cycle
        state[m] = 'done'; stack.pop()
    for m in graph:
        if m not in state and (cycle := visit(m)): return cycle

def test_no_import_cycle():
    graph = import_graph()
    assert graph['learncb.checkpoint'] and 'learncb.learner' in graph['learncb.checkpoint']    # the graph is read
    assert find_cycle(graph) is None, f'import cycle: {" -> ".join(find_cycle(graph))}'

def test_cycle_finder_finds_one():
    assert find_cycle({'a': ['b'], 'b': ['c'], 'c': ['a']}) == ['a', 'b', 'c', 'a']
    assert find_cycle({'a': ['b'], 'b': [], 'c': ['a']}) is None

def test_learner_holds_no_file_format():
    "Writing, checksums and safe loading live in `learncb.files`, below the learner and the checkpoints"
    src = (PKG/'learner.py').read_text()
    for word in ('torch.save(', 'torch.load(', 'hashlib', 'os.replace', 'fsync'): assert word not in src, word
    graph = import_graph()
    assert 'learncb.files' in graph['learncb.learner'] and 'learncb.files' in graph['learncb.checkpoint']
    assert not {'learncb.learner', 'learncb.checkpoint'} & set(graph['learncb.files'])
