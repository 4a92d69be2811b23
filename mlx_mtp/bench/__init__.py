"""``mlx-mtp bench``: Spec-Bench / GSM8K harness, metrics, reports and plots."""
