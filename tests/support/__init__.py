"""What the tests share beyond fixtures, importable as ``support`` (pyproject's pytest
``pythonpath`` puts tests/ on the path; a process a test spawns inherits it):

- :mod:`support.harness`: the CLI in process, trees compared bit for bit, torch calls
  counted, a training run's checkpoints and metrics read back;
- :mod:`support.ops_backends`: a block run on the C++ kernels or the Python references, and
  ``torch._int_mm`` checked for the layouts oneDNN misreads;
- :mod:`support.patterns`: torch-native copies of torchvision, timm and Swin model patterns;
- :mod:`support.pipeline_jobs`: one rank of a multi-process pipeline training, for the test
  that compares it with the one-process pipeline.

None of it ships in the wheel (tests/test_wheel.py).
"""
