"""Tests for procap_jax/ablations.py (the table and the results file; the runs themselves are
ordinary `main` runs tested elsewhere)."""

from procap_jax import ablations


def _run(cider, change):
  return {'metrics': {'CIDEr': cider, 'Bleu_4': 0.1, 'METEOR': 0.2, 'ROUGE_L': 0.3,
                      'change/CIDEr': change, 'no_change/CIDEr': 0.0, 'color/CIDEr': change}}


def test_table_mean_and_std_over_seeds_with_the_paper_column():
  runs = [_run(0.4, 0.6), _run(0.6, 0.8)]
  runs[0]['distinct_captions'], runs[1]['distinct_captions'] = 1, 37
  text = ablations.table({'k2': runs, 'static': [_run(0.5, 0.5)]})
  rows = text.splitlines()
  static_row = next(r for r in rows if r.startswith('| static'))
  k2_row = next(r for r in rows if r.startswith('| full, k = 2'))
  assert '| 1 |' in static_row and '50.0' in static_row and '108.4' in static_row
  assert '| 2 |' in k2_row and '50.0 ± 10.0' in k2_row and '70.0 ± 10.0' in k2_row
  assert '135.6' in k2_row and '| 1, 37 |' in k2_row and '| ? |' in static_row
  assert rows.index(static_row) < rows.index(k2_row)  # VARIANTS order, not insertion order


def test_merge_keeps_hand_written_text_outside_the_markers(tmp_path):
  path = tmp_path / 'results.md'
  assert ablations.merge_into(str(path), 'T1\n') == (
      f'{ablations.BEGIN}\nT1\n{ablations.END}\n')
  path.write_text('# Results\n\n' + ablations.merge_into(str(path), 'T1\n') +
                  '\n## Analysis\nkept\n')
  merged = ablations.merge_into(str(path), 'T2\n')
  assert merged.startswith('# Results\n\n' + ablations.BEGIN + '\nT2\n')
  assert 'T1' not in merged and merged.endswith('\n## Analysis\nkept\n')


def test_no_queries_reuses_the_stage1_of_k2_which_runs_first():
  for variant, source in ablations.SHARED_STAGE1.items():
    assert ablations.RUN_ORDER.index(source) < ablations.RUN_ORDER.index(variant)
  assert sorted(ablations.RUN_ORDER) == sorted(ablations.VARIANTS)
