"""Knowledge distillation, as in the Keras example; only the import differs.

A `Distiller` (a subclassed model holding a teacher and a student,
overriding `compile`, `compute_loss` and `call`) trains the student on
the true labels and on the teacher's softened predictions, as in
keras.io/examples/vision/knowledge_distillation (with small MLPs and
synthetic data, so it runs in seconds on a CPU and downloads nothing).
With flexflow_keras the teacher's fit and the distillation both train
under searched strategies (4 virtual CPUs without a GPU).

    python examples/distillation.py --budget 200
"""

import argparse

import numpy as np

import flexflow_keras as keras  # was: import keras
from flexflow_keras import layers, ops


class Distiller(keras.Model):
    def __init__(self, student, teacher):
        super().__init__()
        self.teacher = teacher
        self.student = student

    def compile(self, optimizer, metrics, student_loss_fn,
                distillation_loss_fn, alpha=0.1, temperature=3):
        super().compile(optimizer=optimizer, metrics=metrics)
        self.student_loss_fn = student_loss_fn
        self.distillation_loss_fn = distillation_loss_fn
        self.alpha = alpha
        self.temperature = temperature

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None,
                     allow_empty=False):
        teacher_pred = self.teacher(x, training=False)
        student_loss = self.student_loss_fn(y, y_pred)
        distillation_loss = self.distillation_loss_fn(
            ops.softmax(teacher_pred / self.temperature, axis=1),
            ops.softmax(y_pred / self.temperature, axis=1),
        ) * (self.temperature ** 2)
        return self.alpha * student_loss + (1 - self.alpha) * distillation_loss

    def call(self, x):
        return self.student(x)


def make_data(samples: int, features: int, classes: int, seed: int):
    teacher = np.random.default_rng(1234).normal(size=(features, classes))
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(samples, features)).astype("float32")
    y = np.argmax(np.tanh(x) @ teacher, axis=1)
    return x, y


def mlp(name: str, width: int) -> keras.Sequential:
    return keras.Sequential([
        keras.Input(shape=(32,)),
        layers.Dense(width, activation="relu"),
        layers.Dense(width, activation="relu"),
        layers.Dense(10),  # logits
    ], name=name)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()

    x, y = make_data(4096, 32, 10, seed=0)
    x_test, y_test = make_data(1024, 32, 10, seed=1)
    teacher, student = mlp("teacher", 256), mlp("student", 64)

    teacher.compile(
        optimizer=keras.optimizers.Adam(),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[keras.metrics.SparseCategoricalAccuracy()],
    )
    teacher.fit(x, y, batch_size=args.batch_size, epochs=args.epochs,
                verbose=2)

    distiller = Distiller(student=student, teacher=teacher)
    distiller.compile(
        optimizer=keras.optimizers.Adam(),
        metrics=[keras.metrics.SparseCategoricalAccuracy()],
        student_loss_fn=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True
        ),
        distillation_loss_fn=keras.losses.KLDivergence(),
        alpha=0.5,
        temperature=3,
    )
    distiller.fit(x, y, batch_size=args.batch_size, epochs=args.epochs,
                  verbose=2)
    results = distiller.evaluate(x_test, y_test, verbose=0,
                                 return_dict=True)
    print(f"test accuracy {results['sparse_categorical_accuracy']:.4f}")


if __name__ == "__main__":
    main()
