"""flexflow_keras: Keras 3 with FlexFlow's simulator-guided parallelization."""

from setuptools import Extension, find_packages, setup

setup(
    name="flexflow_keras",
    version="0.1.0",
    description=(
        "Change one import in a Keras 3 script: compile() searches a "
        "per-operator parallel strategy (FlexFlow's SOAP space, MCMC over an "
        "execution simulator) and fit() runs it on TensorFlow DTensor."
    ),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["flexflow_keras", "flexflow_keras.*"]),
    # The simulator's list-scheduling loop in C (2-5x more delta
    # simulations a second: bench/simulator_bench.py, InceptionV3 740
    # against 153, DLRM 11,756 against 5,896). Optional: without a C
    # compiler the install goes on and flexflow_keras.schedule runs the
    # same loop in Python.
    ext_modules=[
        Extension(
            "flexflow_keras._listsched",
            ["flexflow_keras/_listsched.c"],
            optional=True,
        )
    ],
    python_requires=">=3.10",
    install_requires=[
        "tensorflow>=2.21,<2.22",
        "keras>=3.15,<3.16",
        "numpy>=1.26,<3",  # verified: 2.4
        "protobuf>=6.31.1,<8",  # what TensorFlow 2.21 accepts
        "absl-py>=2.1",
    ],
    # bench: Keras on JAX in bench/runtime_bench.py (side by side only).
    extras_require={"test": ["pytest>=8"], "bench": ["jax"]},
    entry_points={
        "console_scripts": ["flexflow-keras=flexflow_keras.__main__:main"]
    },
)
