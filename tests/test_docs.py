"Every exported name has a docstring and a `show_doc` in the notebook it comes from"
import importlib, inspect, json, re
from pathlib import Path
import pytest
from learncb.learner import Learner

ROOT = Path(__file__).resolve().parent.parent

def _exported_modules():
    "`{module: notebook}` for every notebook that exports a module (its `#| default_exp` line)"
    found = {}
    for nb in sorted((ROOT/'nbs').glob('[0-9]*.ipynb')):
        m = re.search(r'#\|\s*default_exp\s+([\w.]+)', nb.read_text())
        if m: found[m[1]] = nb.stem
    return found

MODULES = _exported_modules()

def notebook_code(nb_name):
    nb = json.loads((ROOT/'nbs'/f'{nb_name}.ipynb').read_text())
    return '\n'.join(''.join(c['source']) for c in nb['cells'] if c['cell_type'] == 'code')

def own_doc(obj):
    return obj.__doc__ if inspect.isclass(obj) or inspect.isroutine(obj) or isinstance(obj, property) else 'n/a'

@pytest.mark.parametrize('mod_name', MODULES)
def test_exported_names_documented(mod_name):
    mod, code = importlib.import_module(f'learncb.{mod_name}'), notebook_code(MODULES[mod_name])
    shown = set(re.findall(r'show_doc\(([\w.]+)', code))
    for name in mod.__all__:
        obj = getattr(mod, name)
        if not (inspect.isclass(obj) or inspect.isroutine(obj)): continue       # data such as `event`, `batch_events`
        if obj.__name__ != name: name = obj.__name__                           # an alias: `CancelBatch`
        assert own_doc(obj), f'learncb.{mod_name}.{name} has no docstring'
        assert name in shown, f'learncb.{mod_name}.{name} has no show_doc in nbs/{MODULES[mod_name]}.ipynb'

def test_learner_methods_documented():
    "Every public method of `Learner`, its own or of a host it is built from (`CallbackHost`, ...), is shown"
    code = '\n'.join(notebook_code(nb) for nb in MODULES.values())
    hosts = [c for c in Learner.__mro__ if c is not object]
    assert len(hosts) >= 5, hosts                     # Learner and the hosts of callbacks, optimizer, weights, preds
    for cls in hosts:
        for name, obj in vars(cls).items():
            if name.startswith('_') or not (inspect.isroutine(obj) or isinstance(obj, property)): continue
            assert own_doc(obj), f'{cls.__name__}.{name} has no docstring'
            if inspect.isroutine(obj): assert f'show_doc({cls.__name__}.{name})' in code or \
                f'show_doc(Learner.{name})' in code, f'{cls.__name__}.{name} has no show_doc'
