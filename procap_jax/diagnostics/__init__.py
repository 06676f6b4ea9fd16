"""Analysis tools run on a training run's workdir; each prints one JSON line per measurement.

  python -m procap_jax.diagnostics.code_statistics --workdir W    the tokenizer's code statistics
  python -m procap_jax.diagnostics.probe_consistency --workdir W  probes of stage 1's binary tasks
  python -m procap_jax.diagnostics.probe_attributes --workdir W   what a pair shows of its change
  python -m procap_jax.diagnostics.head_logits --workdir W        stage-1 binary heads' raw logits
  python -m procap_jax.diagnostics.diagnose_caption --workdir W   why a captioner ignores images
  python -m procap_jax.diagnostics.memory_attention --workdir W   where the decoder looks
  python -m procap_jax.diagnostics.match_ceiling                  caption matching's ceiling
  python -m procap_jax.diagnostics.reliability_table --out docs/reliability.md

Speed and memory measurements are in bench/.
"""
