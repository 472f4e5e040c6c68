"""Test set-up: virtual CPU devices exist before TensorFlow initialises.

Importing flexflow_keras first creates the devices (4 by default, or
FLEXFLOW_KERAS_CPU_DEVICES), the way a user script gets them.
"""

import os
import sys

# The model zoo the tests share with the benches (bench/model_zoo.py).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), "bench"))

os.environ.setdefault("FLEXFLOW_KERAS_CPU_DEVICES", "4")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import flexflow_keras  # noqa: E402,F401

# A long run's test files are shared between two processes (two_processes.py).
from two_processes import *  # noqa: E402,F401,F403
