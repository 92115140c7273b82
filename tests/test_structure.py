"""The package's shape: its layers and what may import what, no import cycle, `Learner` readable as classes
(no `@patch` onto a class of the same module, no reading of frame locals), no module over 450 lines, and a
learner that needs no other import than its own module."""
import ast, re, subprocess, sys, textwrap
import pytest, torch
from pathlib import Path
import learncb

PKG = Path(learncb.__file__).parent

# What every fit uses: the loop and the parts `Learner` is built from. Nothing here imports (at its top) a
# module of
# the layers above: schedules, checkpoints, distributed strategies, inference, integrations.
loop_layer = {f'learncb.{m}' for m in ('core', 'utils', 'files', 'checks', 'diagnose', 'dispatch', 'optim',
                                       'weights',
                                       'metrics', 'recorder', 'progress', 'preds', 'learner', 'ranks',
                                       'sampler',
                                       'state', 'resume', 'step', 'strategy', 'internals', 'items',
                                       'session')}
# Imports made inside a function, when the feature is asked for: these alone run against the layers
# fit(resume=...): the CheckpointCallback, the store
lazy_allowed = {('learncb.resume', 'learncb.checkpoint.callback'),
                ('learncb.resume', 'learncb.checkpoint.store'),
                # save_checkpoint/load_checkpoint by hand: the store
                ('learncb.state', 'learncb.checkpoint.callback'),
                # a sharded checkpoint's tensors, read when loaded
                ('learncb.state', 'learncb.checkpoint.store'),
                ('learncb.checks', 'learncb.metrics')}            # a metric given by name: suggest the import

def module_name(path):
    return '.'.join(('learncb', *path.relative_to(PKG).with_suffix('').parts)).removesuffix('.__init__')

def modules():
    return {module_name(p): p for p in PKG.rglob('*.py') if p.name not in ('_modidx.py', 'all.py')}

def _resolve(node, name, is_init):
    "The module names an import node names (`from .x import y` gives `learncb.x` and `learncb.x.y`)"
    if isinstance(node, ast.Import): return {a.name for a in node.names}
    if isinstance(node, ast.Call): return {node.args[0].value}
    base = node.module or ''
    if node.level:
        package = name if is_init else name.rpartition('.')[0]
        parts = package.split('.')[:len(package.split('.')) - node.level + 1]
        base = '.'.join(parts + ([base] if base else []))
    return {base} | {f'{base}.{a.name}' for a in node.names}

def _is_import(node):
    return isinstance(node, (ast.Import, ast.ImportFrom)) or (
        isinstance(node, ast.Call) and getattr(node.func, 'attr', None) == 'import_module' and node.args
        and isinstance(node.args[0], ast.Constant))

def imported(path, known):
    """`(top, lazy)`: the learncb modules `path` imports at its top level, and those it imports inside
    functions"""
    name,top,lazy = module_name(path),set(),set()
    def visit(node, inside):
        for child in ast.iter_child_nodes(node):
            now = inside or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if _is_import(child):
                found = {m for m in _resolve(child, name, path.name == '__init__.py') if m in known
                         and m != name}
                packages = {m.rpartition('.')[0] for m in found}  # `from pkg import mod`: the module counts
                (lazy if now else top).update(found - packages if found - packages else found)
            visit(child, now)
    visit(ast.parse(path.read_text()), False)
    return top,lazy

def import_graph():
    "`module -> (top-level imports, imports inside functions)` over learncb's modules"
    mods = modules()
    return {m: imported(p, mods) for m,p in mods.items()}

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

def test_no_import_cycle_also_inside_functions():
    "No module imports one that imports it back, counting the imports made inside functions"
    graph = {m: sorted(top | lazy) for m,(top,lazy) in import_graph().items()}
    assert ('learncb.checkpoint.callback' in graph['learncb.resume'] and 'learncb.recorder'
            in graph['learncb.learner'])
    assert find_cycle(graph) is None, f'import cycle: {" -> ".join(find_cycle(graph))}'

def test_learner_imports_nothing_of_the_checkpoint_layer():
    """The loop knows where to start (`learncb.resume`); the checkpoint layer is below it and never imports it
    back"""
    graph = import_graph()
    top,lazy = graph['learncb.learner']
    assert not [m for m in top | lazy if m.startswith('learncb.checkpoint')], top | lazy
    back = {m: sorted(n for n in top | lazy if n in ('learncb.learner', 'learncb.state', 'learncb.resume'))
            for m,(top,lazy) in graph.items() if m.startswith('learncb.checkpoint')}
    assert not any(back.values()), back

def test_cycle_finder_finds_one():
    assert find_cycle({'a': ['b'], 'b': ['c'], 'c': ['a']}) == ['a', 'b', 'c', 'a']
    assert find_cycle({'a': ['b'], 'b': [], 'c': ['a']}) is None

def test_loop_layer_imports_nothing_above_it():
    graph = import_graph()
    assert loop_layer <= set(graph), loop_layer - set(graph)
    above = {m: sorted(top - loop_layer) for m,(top,_) in graph.items() if m in loop_layer
             and top - loop_layer}
    assert not above, f'modules of the loop layer import modules above it at their top: {above}'

def test_lazy_imports_are_the_known_ones():
    lazy = {(m, n) for m,(_,lz) in import_graph().items() for n in lz if n != 'learncb'}
    assert lazy == lazy_allowed, (f'imports inside functions changed: new {lazy - lazy_allowed}, '
                                  f'gone {lazy_allowed - lazy}')

def test_learner_holds_no_file_format():
    """Writing, checksums and safe loading live in `learncb.files`, below the learner, its weights and the
    checkpoints"""
    for mod in ('learner.py', 'weights.py', 'dispatch.py', 'optim.py'):
        src = (PKG/mod).read_text()
        for word in ('torch.save(', 'torch.load(', 'hashlib', 'os.replace', 'fsync'):
            assert word not in src, (mod, word)
    graph = import_graph()
    assert ('learncb.files' in graph['learncb.weights'][0] and 'learncb.files'
            in graph['learncb.checkpoint.callback'][0])
    assert not {'learncb.learner', 'learncb.checkpoint.callback'} & graph['learncb.files'][0]

def _is_patch(d):
    f = d.func if isinstance(d, ast.Call) else d
    return isinstance(f, ast.Name) and f.id == 'patch'

def patched_onto_own_class(src):
    "`(function, class)` for each `@patch` function of `src` whose class `src` itself defines"
    tree = ast.parse(src)
    own = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    found = []
    for fn in ast.walk(tree):
        if not (isinstance(fn, ast.FunctionDef) and any(_is_patch(d) for d in fn.decorator_list)): continue
        ann = fn.args.args[0].annotation if fn.args.args else None
        classes = {c.strip() for c in ast.unparse(ann).strip('()').split('|')} if ann is not None else set()
        found += [(fn.name, c) for c in sorted(classes & own)]
    return found

def test_patch_finds_a_class_of_the_same_module():
    src = textwrap.dedent('''
        class A: pass
        class B: pass
        @patch
        def f(self:A): pass
        @patch(as_prop=True)
        def g(self:(A|B)): pass
        @patch
        def h(self:Learner): pass''')
    assert patched_onto_own_class(src) == [('f', 'A'), ('g', 'A'), ('g', 'B')]

def test_no_patch_onto_a_class_of_the_same_module():
    found = {module_name(p): hits for p in PKG.rglob('*.py')
             if (hits := patched_onto_own_class(p.read_text()))}
    assert not found, f'@patch onto a class defined in the same module (put the method in the class): {found}'

def private_patches(src):
    "`[(name, class)]` of the private functions `src` adds to a class with `@patch`"
    return [(f.name, f.args.args[0].annotation.id) for f in ast.walk(ast.parse(src))
            if isinstance(f, ast.FunctionDef) and f.name.startswith('_') and not f.name.startswith('__')
            and any(getattr(d, 'id', None) == 'patch' for d in f.decorator_list)
            and f.args.args and isinstance(f.args.args[0].annotation, ast.Name)]

def test_private_patches_are_found():
    src = "@patch\ndef _a(self:Learner): pass\n@patch\ndef b(self:Learner): pass\ndef _c(learn): pass"
    assert private_patches(src) == [('_a', 'Learner')]

def test_no_private_patch():
    "What a module adds to `Learner` is public; its private helpers are functions that take the learner"
    found = {module_name(p): hits for p in PKG.rglob('*.py') if (hits := private_patches(p.read_text()))}
    assert not found, f'private methods patched onto a class (make them functions of the module): {found}'

def test_no_frame_locals():
    "Error notes come from what the loop records, not from reading the variables of traceback frames"
    assert not [p.name for p in PKG.rglob('*.py') if 'f_locals' in p.read_text()]

WIDTH = 110

def nbdev_all_lines(text):
    "The line numbers of the `__all__ = [...]` statement nbdev-export writes (it wraps it at 120 characters)"
    return {n for node in ast.parse(text).body if isinstance(node, ast.Assign)
            and any(getattr(t, 'id', None) == '__all__' for t in node.targets)
            for n in range(node.lineno, node.end_lineno + 1)}

def long_lines(text):
    skip = nbdev_all_lines(text)
    return [i for i,line in enumerate(text.splitlines(), 1) if len(line) > WIDTH and i not in skip]

def test_long_lines_are_found():
    text = f"__all__ = ['a',\n           '{'b' * 120}']\nx = 1\ny = '{'c' * 110}'\n"
    assert long_lines(text) == [4]

def test_lines_fit_a_screen():
    "No line of learncb/ or tests/ over 110 characters, code or docstring (`tools/wrap_lines.py` wraps them)"
    files = [p for d in (PKG, PKG.parent/'tests') for p in d.rglob('*.py') if p.name != '_modidx.py']
    found = [f'{p.relative_to(PKG.parent)}:{i}' for p in files for i in long_lines(p.read_text())]
    assert len(files) > 100 and not found, found

# The size a module of one idea stays under, as a guide: a module over it is split where its ideas part. Those
# below are over it and hold one idea each, which a cut would leave in two files: they stay whole, under a
# ceiling.
GUIDE, CEILING = 450, 520
one_idea = {
    'learncb.recorder': "the Recorder alone: the history, the epoch table, smoothing, metrics per phase",
    'learncb.callbacks.guards': "SpikeGuard and TerminateOnNaN (a SpikeGuard that watches for NaN only)",
    'learncb.distributed.ft': "TorchFT, its FaultTolerantStep and ReplicaCallback: one protocol, quorum to "
                              "commit",
    'learncb.inference.export': "an item or a file for inference: test_dl, predict, export, load_learner",
    'learncb.preds': "predictions on any dataloader: gathering, get_preds, validate, FetchPredsCallback"}

def test_module_sizes():
    "One idea a file: no module over 450 lines (the index nbdev writes aside) but those of one idea, said why"
    sizes = {module_name(p): len(p.read_text().splitlines()) for p in PKG.rglob('*.py')
             if p.name != '_modidx.py'}
    over = {m: n for m,n in sizes.items() if n > GUIDE}
    assert not {m: n for m,n in over.items() if m not in one_idea or n > CEILING}, over
    back = set(one_idea) - set(over)
    assert not back, f'under {GUIDE} lines now, no longer an exception: {back}'

def test_strategies_touch_no_private_attribute_of_the_learner():
    """A strategy sets itself up through the learner's public hooks (model, opt, owns_opt, create_opt,
    forward_batch)"""
    found = [f'{p.name}:{i}: {line.strip()}' for p in (PKG/'distributed').glob('*.py')
             for i,line in enumerate(p.read_text().splitlines(), 1) if re.search(r'\blearn\._', line)]
    assert not found, found

learner_alone = """
import sys, torch
from pathlib import Path
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from learncb.learner import Learner, DataLoaders
# the class's own
assert {{'state_dict', 'load_state_dict', 'save_checkpoint', 'load_checkpoint'}} <= set(dir(Learner))
{imports}
torch.manual_seed(0)
x = torch.randn(64, 2); y = (x.sum(1) > 0).long()
dl = DataLoader(TensorDataset(x, y), batch_size=16)
learn = Learner(DataLoaders(dl, dl), nn.Linear(2, 2), nn.CrossEntropyLoss(), path=sys.argv[1])
names = [type(cb).__name__ for cb in learn.cbs]
with learn.no_bar(), learn.no_logging():
    {fit}
assert len(learn.recorder.values) == 3, learn.recorder.values
torch.save(learn.model.state_dict(), Path(sys.argv[1])/'weights.pt')
print(sorted(m for m in sys.modules if m.startswith('learncb.') and '.' in m[8:]))
print(names)
"""

def _run(folder, imports='', fit='learn.fit(3, resume="auto")'):
    code = learner_alone.format(imports=imports, fit=fit)
    return subprocess.run([sys.executable, '-c', code, str(folder)], capture_output=True, text=True,
                          timeout=120)

@pytest.mark.slow
def test_learner_module_alone_gives_the_whole_learner(tmp_path):
    """`from learncb.learner import Learner` in a fresh process: the default callbacks, and `resume='auto'`
    resumes"""
    crash = ('from learncb.all import CheckpointCallback, Callback\nclass Crash(Callback):\n    def '
             'after_batch(self):\n        if self.train_iter == 6: raise RuntimeError("crash")')
    res = _run(tmp_path/'run', crash, 'learn.fit(3, cbs=[CheckpointCallback(every_n_steps=2, '
                                      'on_exception=False), Crash()])')
    # stopped at batch 6: checkpoints kept
    assert res.returncode != 0 and 'crash' in res.stderr, res.stderr[-2000:]
    res = _run(tmp_path/'run')  # nothing imported but learncb.learner
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resume='auto': resuming the run from" in res.stdout, res.stdout
    assert res.stdout.strip().splitlines()[-1] == "['TrainEvalCallback', 'Recorder', 'ProgressCallback']"
    assert 'learncb.callbacks.policies' not in res.stdout and 'learncb.checkpoint.callback' in res.stdout
    whole = _run(tmp_path/'whole', 'from learncb.all import CheckpointCallback',
                 'learn.fit(3, cbs=CheckpointCallback(every_n_steps=2))')
    assert whole.returncode == 0, whole.stderr[-3000:]
    a, b = (torch.load(tmp_path/d/'weights.pt') for d in ('run', 'whole'))
    assert all(torch.equal(a[k], b[k]) for k in a)

def test_only_the_strategies_ask_whether_a_model_is_sharded():
    """A strategy says whether the state is sharded (`learn.strategy.sharded`): no module outside
    `distributed/` asks"""
    asking = [module_name(p) for p in PKG.rglob('*.py') if p.name != '_modidx.py' and 'distributed' not
              in p.parts
              # `ranks` defines it; nobody else asks
              and p.name != 'ranks.py' and 'is_sharded(' in p.read_text()]
    assert not asking, asking
    assert not [module_name(p) for p in PKG.rglob('*.py') if p.name != '_modidx.py' and 'unsharded'
                in p.read_text()]

def test_file_or_folder_is_decided_by_the_stores():
    """Whether a checkpoint is a file or a folder is the stores' business: the callback and the state never
    look"""
    for path in (PKG/'checkpoint'/'callback.py', PKG/'state.py', PKG/'resume.py'):
        src,mod = path.read_text(),path.name
        for word in ('is_dir()', "'folder' in", 'rmtree', 'unlink(', 'read_sharded', 'save_sharded',
                     'start_sharded'):
            assert word not in src, (mod, word)

# What each folder may import at its top, beside the loop layer and its own folder
folder_may_import = {
    'callbacks': set(),
    'checkpoint': set(),
    'inference': {'callbacks'},
    # the strategies' stores and resumable order; FSDP's precision
    'distributed': {'checkpoint', 'callbacks'},
    # trackers save the model as SaveModelCallback does; Ray reports checkpoints
    'integrations': {'callbacks', 'checkpoint'},
}

def _folder(m): return m.split('.')[1] if m.count('.') >= 2 else None

def test_folders_import_only_what_their_layer_may():
    graph,bad = import_graph(),{}
    for m,(top,_) in graph.items():
        f = _folder(m)
        if f is None or m in loop_layer: continue
        allowed = folder_may_import[f] | {f}
        if (wrong := sorted(n for n in top - loop_layer if _folder(n) not in allowed)): bad[m] = wrong
    assert set(folder_may_import) == {_folder(m) for m in graph} - {None}      # every folder has its rule
    assert not bad, f'imports across layers that the layering does not allow: {bad}'

def test_no_private_name_is_imported_across_modules():
    "A module takes only public names from another (`from .checks import _is_optimizer` was one that was not)"
    found = []
    for p in PKG.rglob('*.py'):
        if p.name == '_modidx.py': continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or '').startswith('learncb')):
                found += [f'{module_name(p)}: {a.name}' for a in node.names if a.name.startswith('_')]
    assert not found, found

private_torch = re.compile(
    r"torch\._(?!_)|torch\.utils\._|\.__wrapped__|\._orig_mod\b|\._version\b|_optimizer_step_|"
    r"_global_optimizer_|_profiler_enabled|_backward_hooks|_post_accumulate_grad_hooks|"
    r"_step_supports_amp_scaling|\.found_inf\b|\._metadata\b|\._enabled\b")
python_own = {'_getframe', '_fields', '_asdict', '_replace', '_make'}  # Python's (sys, namedtuple), public

def _private_uses(tree, learncb_names):
    """What `tree` takes from torch's private API: names imported, attributes learncb does not define, name
    strings"""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or '').startswith('torch'):
            yield from (f'from {node.module} import {a.name}' for a in node.names
                        if a.name.startswith('_') or any(p.startswith('_') for p in node.module.split('.')))
        elif isinstance(node, ast.Attribute):
            src = ast.unparse(node).split('(')[0]
            if private_torch.search(src): yield src
            elif (node.attr.startswith('_') and not node.attr.startswith('__') and node.attr not
                  in learncb_names
                  and node.attr not in python_own): yield src
        elif (isinstance(node, ast.Call) and getattr(node.func, 'id', None) in ('getattr', 'hasattr',
                'setattr', 'delattr')
              and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)
              and isinstance(node.args[1].value, str)):
            name = node.args[1].value
            if (name.startswith('_') and not name.startswith('__')) or private_torch.search('.' + name):
                yield ast.unparse(node)

def _defined_names(trees):
    "The names learncb defines: functions, classes, arguments, attributes and variables it assigns"
    names = set()
    for tree in trees:
        for n in ast.walk(tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)): names.add(n.name)
            elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store): names.add(n.attr)
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store): names.add(n.id)
            elif isinstance(n, ast.arg): names.add(n.arg)
            elif (isinstance(n, ast.Call) and getattr(n.func, 'attr', n.func.__dict__.get('id'))
                  in ('setattr', '__setattr__')
                  and len(n.args) > 1 and isinstance(n.args[1], ast.Constant)): names.add(n.args[1].value)
    return names

def test_torch_internals_are_used_in_one_module():
    """Only learncb.internals reaches into torch's private API (strings in messages and comments aside): no
    private name imported from torch, no private attribute learncb does not define itself, no private name in
    a getattr"""
    trees = {name: ast.parse(path.read_text()) for name, path in modules().items()}
    learncb_names = _defined_names(t for n,t in trees.items() if n != 'learncb.internals')
    found = [f'{name}: {use[:80]}' for name, tree in trees.items() if name != 'learncb.internals'
             for use in _private_uses(tree, learncb_names)]
    assert not found, sorted(set(found))
