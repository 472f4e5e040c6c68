"""Test set-up: virtual CPU devices exist before TensorFlow initialises.

Importing flexflow_keras first creates the devices (4 by default, or
FLEXFLOW_KERAS_CPU_DEVICES), the way a user script gets them.
"""

import os

os.environ.setdefault("FLEXFLOW_KERAS_CPU_DEVICES", "4")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import flexflow_keras  # noqa: E402,F401
