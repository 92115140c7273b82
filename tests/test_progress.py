"ProgressCallback in a terminal, in a log (no TTY) and in a real Jupyter kernel"
import os, pty, subprocess, sys, textwrap
import pytest

FIT = textwrap.dedent('''
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    from learncb.all import *
    torch.manual_seed(0)
    x = torch.randn(512, 2); y = (x.sum(1) > 0).long()
    dl = DataLoader(TensorDataset(x, y), batch_size=16)
    learn = Learner(DataLoaders(dl, dl), nn.Linear(2, 2), nn.CrossEntropyLoss(), metrics=accuracy,
                    device='cpu')
    learn.fit(2)
''')

def run_in_pty(code):
    "Run `code` in a Python subprocess whose stdout is a terminal; return what it printed"
    out = []
    def read(fd):
        data = os.read(fd, 4096); out.append(data); return data
    status = pty.spawn([sys.executable, '-c', code], read)
    assert os.waitstatus_to_exitcode(status) == 0, b''.join(out).decode(errors='replace')
    return b''.join(out).decode(errors='replace')

def test_terminal_shows_bars_and_table():
    out = run_in_pty(FIT)
    assert 'Epoch 1/2' in out and '|' in out and '[32/32' in out        # the batch bar, at its end
    lines = [l.split('\r')[-1].split() for l in out.splitlines()]
    assert ['epoch', 'train_loss', 'valid_loss', 'accuracy', 'time'] in lines
    assert sum(1 for l in lines if l[:1] in (['0'], ['1']) and len(l) == 5) == 2     # two rows of the table

def test_without_tty_only_the_table_is_printed():
    res = subprocess.run([sys.executable, '-c', FIT], capture_output=True, text=True, check=True)
    lines = res.stdout.splitlines()
    assert lines[0].split() == ['epoch', 'train_loss', 'valid_loss', 'accuracy', 'time']
    assert [l.split()[0] for l in lines[1:]] == ['0', '1'] and '[' not in res.stdout

@pytest.mark.slow
def test_jupyter_kernel_shows_html_bars_and_table():
    """A real kernel: every display message is collected, since the bars are updated in place and removed at
    the end"""
    manager = pytest.importorskip('jupyter_client.manager')
    km, kc = manager.start_new_kernel(kernel_name='python3')
    try:
        messages = []
        reply = kc.execute_interactive(FIT, timeout=120, output_hook=messages.append)
        assert reply['content']['status'] == 'ok', reply['content']
    finally:
        kc.stop_channels(); km.shutdown_kernel(now=True)
    html = [m['content']['data'].get('text/html', '') for m in messages
            if m['msg_type'] in ('display_data', 'update_display_data')]
    assert any('<progress' in h for h in html), 'no progress bar was displayed'
    final_table = [h for h in html if 'train_loss' in h][-1]
    assert '<th>train_loss</th>' in final_table and '<td>1</td>' in final_table     # header, then rows
    assert not any(m['msg_type'] == 'stream' and 'train_loss' in m['content']['text'] for m in messages)
