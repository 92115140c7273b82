"The public API of learncb: `from learncb.all import *`"
# Hand-written (not exported from a notebook): it only gathers the public names of the modules.
from .core import *
from .utils import *
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
from .tracker import *
from .schedule import *
from .lr_find import *
from .training import *
from .loggers import *
from .evaluation import *
from .sharded import *
from .preemption import *
from .checkpoint import *
from .interpret import *
from .summary import *
from .inference import *
from .distributed import *
from .compiling import *
from .tricks import *
from .profiling import *
from .hooks import *
from .integrations.tensorboard import *      # the trackers import their packages only when a run opens
from .integrations.mlflow import *
from .integrations.wandb import *
from .integrations.optuna import *
