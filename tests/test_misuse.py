"""The catalogue of misuse: a mistake is reported before the first batch when it can be known then, in words
that name the bad value and the fix; nothing the user had is lost; nothing is ever silently wrong.

The cases live in three files, one per family, gathered here so that `pytest tests/test_misuse.py` runs them
all:
- `misuse_fail_fast.py`: principle 1 (arguments, data, schedules, trackers, other libraries' handler names), a
  replaced model (principle 3) and one fit at a time (principle 4);
- `misuse_first_batch.py`: principle 2 (errors of the first batch gain a note in learncb's words; handlers
  never crash while the loop unwinds), the NaN warning and the header of a resumed run (principle 4);
- `misuse_nothing_lost.py`: principle 3 (loads validate before changing anything, checksums, fallback, the
  user's dataloader, Ctrl-C) and resume checks (principle 4)."""
from misuse_fail_fast import *
from misuse_first_batch import *
from misuse_nothing_lost import *
