"""One JSON line per measurement, as the diagnostics and the benchmarks print them."""

import json


def emit(record: dict) -> None:
  """Prints `record` as one JSON line (floats rounded to 4 decimals) and flushes."""
  out = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in record.items()}
  print(json.dumps(out), flush=True)
