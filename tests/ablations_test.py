"""Tests for procap_jax/ablations.py (the table and the results file; the runs themselves are
ordinary `main` runs tested elsewhere)."""

import json

from procap_jax import ablations


def _run(cider, change, seed=0, decision=0.5):
  return {'seed': seed,
          'metrics': {'CIDEr': cider, 'Bleu_4': 0.1, 'METEOR': 0.2, 'ROUGE_L': 0.3,
                      'change/CIDEr': change, 'no_change/CIDEr': 0.0, 'color/CIDEr': change,
                      'change_decision': decision,
                      **{f'{t}/CIDEr': 0.9 for t in ('material', 'add', 'drop', 'move')}}}


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


def test_goals_state_met_or_missed_with_numbers():
  full = [_run(1.30, 0.9, seed=0, decision=0.95), _run(1.10, 0.5, seed=1, decision=0.91)]
  static = [_run(1.00, 0.5, seed=0), _run(1.05, 0.5, seed=1)]
  no_queries = [_run(1.40, 0.5, seed=0), _run(1.20, 0.5, seed=1)]
  text = ablations.goals({'k2': full, 'static': static, 'no_queries': no_queries})
  lines = text.splitlines()
  assert lines[0] == '- full ProCap test CIDEr >= 120: met (120.0)'
  assert lines[1] == '- change / no-change decision >= 90 %: met (93.0 %)'
  assert lines[2] == '- CIDEr >= 80 on every change type: missed (lowest: color 70.0)'
  # Per-seed differences: full - static = 30, 5 -> 17.5 ± 12.5 > 10 holds.
  static_line = next(x for x in lines if 'static' in x)
  assert 'holds' in static_line and '+17.5 ± 12.5' in static_line and '2 seeds' in static_line
  # no_queries scores above full on both seeds: the ordering is reported as not holding.
  nq_line = next(x for x in lines if x.startswith('- stage 1, no queries'))
  assert 'does not hold' in nq_line and '-10.0' in nq_line
  assert 'k sweep' not in text  # k1 and k4 not run
  assert 'not run' in ablations.goals({'static': static})


def test_decision_and_type_columns():
  runs = [_run(0.4, 0.6, decision=0.6), _run(0.6, 0.8, seed=1, decision=0.7)]
  row = next(r for r in ablations.table({'k2': runs}).splitlines() if r.startswith('| full'))
  assert '65.0 ± 5.0' in row
  typed = next(r for r in ablations.by_type({'k2': runs}).splitlines() if r.startswith('| full'))
  assert '70.0 ± 10.0' in typed and '| n/a |' in typed  # 'none' CIDEr absent in these runs


def test_job_groups_balance_cost_and_keep_shared_stage1_together():
  groups = ablations.job_groups(list(ablations.VARIANTS), 2)
  assert sorted(v for g in groups for v in g) == sorted(ablations.VARIANTS)
  loads = [sum(ablations.COST[v] for v in g) for g in groups]
  assert max(loads) - min(loads) <= max(ablations.COST.values())
  for variant, source in ablations.SHARED_STAGE1.items():
    group = next(g for g in groups if variant in g)
    assert source in group and group.index(source) < group.index(variant)
  assert ablations.job_groups(['k2', 'no_queries'], 2) == [['k2', 'no_queries']]
  assert ablations.job_groups(['static', 'k4'], 1) == [['static', 'k4']]


def test_child_argv_drops_the_per_job_options_in_both_forms():
  argv = ['--root', 'R', '--jobs', '2', '--variants=k2,k4', '--out', 'x.md', '--seeds', '0,1',
          '--override', 'caption.train.steps=5', '--core=1']
  assert ablations.child_argv(argv) == ['--root', 'R', '--seeds', '0,1', '--override',
                                        'caption.train.steps=5']


def test_report_only_reads_finished_runs_and_names_the_missing(tmp_path):
  root = tmp_path / 'abl'
  for variant, seed, cider in (('k2', 0, 0.7), ('k2', 1, 0.5), ('static', 0, 0.6)):
    run = root / f'{variant}_s{seed}'
    (run / 'caption').mkdir(parents=True)
    (run / 'results.json').write_text(json.dumps(_run(cider, cider, seed=seed)))
    (run / 'config.json').write_text(json.dumps({'seed': seed}))
    (run / 'caption' / 'predictions_test.json').write_text(json.dumps(
        [{'image_id': 1, 'caption': 'a'}, {'image_id': 2, 'caption': 'b'}]))
  out = tmp_path / 'results.md'
  ablations.main(['--root', str(root), '--seeds', '0,1', '--variants', 'static,k2',
                  '--report_only', '--out', str(out)])
  text = out.read_text()
  assert 'not finished yet: static seed 1' in text and '--report_only' not in text.split(';')[0]
  k2_row = next(r for r in text.splitlines() if r.startswith('| full, k = 2'))
  assert '| 2 |' in k2_row and '60.0 ± 10.0' in k2_row and '| 2, 2 |' in k2_row
  assert not (root / 'static_s1').exists()  # nothing trained


def test_semantic_columns_beside_cider():
  runs = [_run(0.4, 0.6, decision=0.6), _run(0.6, 0.8, seed=1, decision=0.7)]
  for r, (decision, kind, attrs) in zip(runs, ((0.9, 0.8, 0.5), (0.7, 0.6, 0.3))):
    r['metrics'].update({'semantic/decision': decision, 'semantic/type': kind,
                         'semantic/attributes': attrs})
  text = ablations.table({'k2': runs})
  header, row = text.splitlines()[0], text.splitlines()[2]
  cells = [c.strip() for c in row.split('|')[1:-1]]
  names = [c.strip() for c in header.split('|')[1:-1]]
  assert len(cells) == len(names)
  got = dict(zip(names, cells))
  assert got['CIDEr'] == '50.0 ± 10.0' and got['CIDEr change pairs'] == '70.0 ± 10.0'
  # The semantic decision, not the older change_decision (60, 70), when a run has both.
  assert got['change / no-change decision %'] == '80.0 ± 10.0'
  assert got['change type %'] == '70.0 ± 10.0' and got['all named attributes %'] == '40.0 ± 10.0'
