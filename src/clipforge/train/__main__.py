"""`python -m clipforge.train`: the train stage (clipforge.train.stage), as a rank's process."""

from clipforge.train.dist import exit_leaving_process_group
from clipforge.train.stage import main

exit_leaving_process_group(main)
