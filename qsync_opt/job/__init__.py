"""A training job: the launcher (`qsync-opt train`), each rank's entry point and the step loop shared by every run."""
