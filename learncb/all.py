"The public API of learncb: `from learncb.all import *`"
# Hand-written (not exported from a notebook): it only gathers the public names of the modules.
from .core import *
from .utils import *
from .distributed.ranks import *
from .files import *
from .checks import *
from .diagnose import *
from .dispatch import *
from .optim import *
from .weights import *
from .learner import *
from .metrics import *
from .recorder import *
from .preds import *
from .progress import *
from .callbacks.monitors import *
from .callbacks.schedule import *
from .callbacks.lr_find import *
from .callbacks.training import *
from .callbacks.loggers import *
from .callbacks.evaluation import *
from .checkpoint.sharded import *
from .checkpoint.preemption import *
from .checkpoint.callback import *
from .inference.interpret import *
from .inference.summary import *
from .inference.export import *
from .distributed.context import *
from .callbacks.compiling import *
from .callbacks.tricks import *
from .callbacks.profiling import *
from .callbacks.hooks import *
from .integrations.tracking import *
from .integrations.tensorboard import *      # the trackers import their packages only when a run opens
from .integrations.mlflow import *
from .integrations.wandb import *
from .integrations.optuna import *
