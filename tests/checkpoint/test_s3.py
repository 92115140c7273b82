"""Checkpoints on S3: `CheckpointCallback(path='s3://bucket/run')` against a real S3 endpoint on
loopback (moto's server, started here on 127.0.0.1 and stopped after), not a mock of fsspec. A run killed and
resumed with resume='auto' equals the run that never checkpointed, on one process and on two with FSDP (each
rank uploads its shards); a checkpoint whose marker is missing is passed over. Bounded by timeouts."""
import os, socket, subprocess, sys, time
from pathlib import Path
import pytest
pytest.importorskip('s3fs', reason='s3fs is not installed (pip install "learncb[s3]")')
pytest.importorskip('moto.server', reason='moto[server] is not installed')
from test_transparent import run, result, assert_same_run
from test_distributed import free_port

@pytest.fixture(scope='module')
def s3():
    "An S3 server on loopback for this module, and the environment that points boto (s3fs) at it"
    port = free_port()
    server = subprocess.Popen([sys.executable, '-m', 'moto.server', '-H', '127.0.0.1', '-p', str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    env = dict(AWS_ENDPOINT_URL=f'http://127.0.0.1:{port}', AWS_ACCESS_KEY_ID='testing',
               AWS_SECRET_ACCESS_KEY='testing', AWS_DEFAULT_REGION='us-east-1')
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(('127.0.0.1', port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError('moto server did not start')
                time.sleep(0.2)
        import s3fs
        s3fs.S3FileSystem(skip_instance_cache=True).mkdir('learncb-test')
        yield 's3://learncb-test'
    finally:
        server.terminate()
        server.wait(timeout=30)
        for k,v in saved.items():
            if v is None: os.environ.pop(k, None)
            else: os.environ[k] = v

def s3_files(url):
    import s3fs
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    return sorted(Path(p).name for p in fs.ls(url, detail=False, refresh=True))

@pytest.mark.slow
@pytest.mark.parametrize('nproc,strategy', [(1, 'ddp'), (2, 'fsdp')])
def test_killed_and_resumed_from_s3_equals_the_run_that_never_checkpointed(s3, tmp_path, nproc, strategy):
    url = f'{s3}/{strategy}{nproc}'
    common = ('--strategy', strategy, '--dropout', '0.25')
    run(tmp_path/'plain', *common, nproc=nproc)
    killed = run(tmp_path/'run', *common, '--ckpt', '--ckpt-path', url, '--kill-at', '13', nproc=nproc,
                 check=False)
    assert killed.returncode != 0
    names = s3_files(url)
    assert 'checkpoint_00000010_batch' + ('.pt' if nproc == 1
                                          else '') in names and not (tmp_path/'run'/'checkpoints').exists()
    res = run(tmp_path/'run', *common, '--ckpt', '--ckpt-path', url, nproc=nproc)
    assert f"resuming the run from {url}/checkpoint_00000010_batch" in res.stdout, res.stdout
    assert_same_run(result(tmp_path/'run'), result(tmp_path/'plain'))

def test_a_checkpoint_without_its_marker_is_passed_over(s3, tmp_path):
    import s3fs
    from learncb.all import Callback, CheckpointCallback
    from learncb.test_utils import synth_learner
    url = f'{s3}/marker'
    learn = synth_learner(path=tmp_path)
    learn.fit(2, cbs=CheckpointCallback(url, every_n_steps=3, keep_last=3))
    assert s3_files(url)[-2:] == ['checkpoint_00000008_epoch_end.pt',
                                  'checkpoint_00000008_epoch_end.pt.complete']
    # upload cut off
    s3fs.S3FileSystem(skip_instance_cache=True).rm(f'{url}/checkpoint_00000008_epoch_end.pt.complete')
    learn,steps = synth_learner(path=tmp_path),[]
    counted = Callback(after_batch=lambda learn: steps.append(learn.train_iter) if learn.training else None)
    with pytest.warns(UserWarning, match='checkpoint_00000008_epoch_end.pt'):
        learn.fit(2, cbs=[CheckpointCallback(url, every_n_steps=3, keep_last=3), counted], resume=True)
    assert learn.train_iter == 8 and steps == [7, 8]  # resumed from step 6, the newest complete checkpoint
