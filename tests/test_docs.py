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
    return obj.__doc__ if inspect.isclass(obj) or inspect.isroutine(obj) or isinstance(obj,
        property) else 'n/a'

@pytest.mark.parametrize('mod_name', MODULES)
def test_exported_names_documented(mod_name):
    mod, code = importlib.import_module(f'learncb.{mod_name}'), notebook_code(MODULES[mod_name])
    shown = set(re.findall(r'show_doc\(([\w.]+)', code))
    for name in mod.__all__:
        obj = getattr(mod, name)
        # data such as `event`, `batch_events`
        if not (inspect.isclass(obj) or inspect.isroutine(obj)): continue
        if obj.__name__ != name: name = obj.__name__                           # an alias: `CancelBatch`
        assert own_doc(obj), f'learncb.{mod_name}.{name} has no docstring'
        assert name in shown, f'learncb.{mod_name}.{name} has no show_doc in nbs/{MODULES[mod_name]}.ipynb'

def test_learner_methods_documented():
    "Every public method of `Learner`, its own or of a host it is built from (`CallbackHost`, ...), is shown"
    code = '\n'.join(notebook_code(nb) for nb in MODULES.values())
    hosts = [c for c in Learner.__mro__ if c is not object]
    assert len(hosts) >= 5, hosts  # Learner and the hosts of callbacks, optimizer, weights, preds
    for cls in hosts:
        for name, obj in vars(cls).items():
            if name.startswith('_') or not (inspect.isroutine(obj) or isinstance(obj, property)): continue
            if (obj.__doc__ or '').startswith('The old name of'): continue     # `renamed_*`, deprecated
            assert own_doc(obj), f'{cls.__name__}.{name} has no docstring'
            if inspect.isroutine(obj): assert f'show_doc({cls.__name__}.{name})' in code or \
                f'show_doc(Learner.{name})' in code, f'{cls.__name__}.{name} has no show_doc'


def test_the_coming_from_page_maps_each_foreign_event_as_the_hints_do():
    """The page's events table agrees with `foreign_events` (the hints), and its table per library is
    `foreign_events` itself"""
    import re
    from fastcore.nbio import read_nb
    from learncb.core import foreign_events, _events
    def names(cell):
        return re.findall(r'`([a-z_]+)`', cell) if not cell.strip().startswith(('(', '-')) else []
    nb = read_nb(ROOT/'nbs'/'18_coming_from.ipynb')
    page = next(c.source for c in nb.cells if '| learncb | fastai | pytorch-accelerated' in c.source)
    checked = []
    for row in (l for l in page.splitlines() if l.startswith('| `')):
        ours,_,pa,fnlp = [c.strip() for c in row.strip('|').split('|')][:4]
        for col,lib in ((pa, 'pytorch-accelerated'), (fnlp, 'fastNLP')):
            for mine,theirs in zip(names(ours), names(col)):
                if (found := foreign_events[lib].get(f'on_{theirs}')):
                    assert found == mine, (f"the page maps {lib}'s on_{theirs} to {mine}, "
                                           f"foreign_events to {found}")
                    checked.append(theirs)
    assert {'train_epoch_end', 'train_epoch_start', 'train_epoch_begin',
            'before_backward'} <= set(checked), checked
    libs = ['pytorch-accelerated', 'fastNLP', 'fastNLP 0.8', 'Lightning', 'Lightning 1.x', 'Keras',
            'fastai v1', 'Hugging Face']
    assert sorted(libs) == sorted(foreign_events)
    rows = ['| learncb | ' + ' | '.join(libs) + ' |', '|---' * (len(libs) + 1) + '|']
    for ev in _events:
        cells = [', '.join(f'`{n}`' for n,e in foreign_events[lib].items() if e == ev) or '-' for lib in libs]
        if any(c != '-' for c in cells): rows.append(f'| `{ev}` | ' + ' | '.join(cells) + ' |')
    per_library = next(c.source for c in nb.cells if '### Where each library fires its handlers' in c.source)
    assert ('\n'.join(rows)
            in per_library), "the page's table per library is not foreign_events: make it again from it"

def public_names(cls):
    """The public methods and properties of `cls`, its hosts' and patched ones too, but the old names of
    renamed ones"""
    found = []
    for name in dir(cls):
        obj = inspect.getattr_static(cls, name)
        if name.startswith('_') or inspect.isclass(obj) or not (callable(obj) or isinstance(obj, property)):
            continue
        if not (obj.__doc__ or '').startswith('The old name of'): found.append(name)
    return found

def test_the_learner_page_lists_what_is_public_on_learner():
    "Its table of public names has each one once, a line each, and the count it says is the count"
    import learncb.all                                   # the modules that add methods to `Learner`
    nb = json.loads((ROOT/'nbs'/'02_learner.ipynb').read_text())
    page = next(''.join(c['source']) for c in nb['cells'] if ''.join(c['source']).startswith('## What a '
        '`Learner`'))
    listed = re.findall(r'^\| `(\w+)` \| \S', page, flags=re.M)
    public = public_names(Learner)
    assert len(listed) == len(set(listed)) and sorted(listed) == sorted(public), set(listed) ^ set(public)
    assert f'Its public names, {len(public)} in all' in page
