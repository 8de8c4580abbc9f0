"""Using a trained model: generation, scoring continuations, evaluation, and
lm-evaluation-harness's model `lmsys`."""
