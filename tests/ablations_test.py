"""Tests for procap_jax/ablations.py and procap_jax/ablation_table.py (the runner, the tables
and the results file; the runs themselves are ordinary `main` runs tested elsewhere)."""

import argparse
import json
import os
import re

import PIL.Image
import pytest

from procap_jax import ablation_clock
from procap_jax import ablation_plot
from procap_jax import ablation_table
from procap_jax import ablations
from procap_jax import errors


def _run(cider, change, seed=0, decision=0.5, **semantic):
  """A run's results: `semantic` gives 'semantic/<key>' scores ('color__new_value' for
  'semantic/color/new_value')."""
  return {'seed': seed,
          'metrics': {'CIDEr': cider, 'Bleu_4': 0.1, 'METEOR': 0.2, 'ROUGE_L': 0.3,
                      'change/CIDEr': change, 'no_change/CIDEr': 0.0, 'color/CIDEr': change,
                      'change_decision': decision,
                      **{f'{t}/CIDEr': 0.9 for t in ('material', 'add', 'drop', 'move')},
                      **{'semantic/' + k.replace('__', '/'): v for k, v in semantic.items()}}}


def _cells(line: str) -> list[str]:
  """A markdown table row's cells (an escaped '\\|' stays inside its cell)."""
  return [c.strip() for c in re.split(r'(?<!\\)\|', line)[1:-1]]


def _columns(text: str, label: str) -> dict[str, str]:
  """{column: cell} of the table row that starts with `label`."""
  lines = text.splitlines()
  row = next(r for r in lines if r.startswith(f'| {label}'))
  return dict(zip(_cells(lines[0]), _cells(row), strict=True))


def test_table_mean_and_std_over_seeds_with_the_paper_column():
  runs = [_run(0.4, 0.6), _run(0.6, 0.8)]
  runs[0]['distinct_captions'], runs[1]['distinct_captions'] = 1, 37
  text = ablation_table.table({'k2': runs, 'static': [_run(0.5, 0.5)],
                               'duda_patches': [_run(0.3, 0.2)]})
  rows = text.splitlines()
  static_row = next(r for r in rows if r.startswith('| static'))
  k2_row = next(r for r in rows if r.startswith('| full, k = 2'))
  duda_row = next(r for r in rows if r.startswith('| DUDA (Park et al., ICCV 2019)'))
  assert '| 1 |' in static_row and '50.0' in static_row and '108.4' in static_row
  assert '| 2 |' in k2_row and '50.0 ± 14.1' in k2_row and '70.0 ± 14.1' in k2_row
  assert '135.6' in k2_row and '| 1, 37 |' in k2_row and '| ? |' in static_row
  assert rows.index(static_row) < rows.index(k2_row)  # VARIANTS order, not insertion order
  assert rows.index(k2_row) < rows.index(duda_row) and duda_row.endswith('| n/a |')
  assert _columns(text, 'DUDA')['CIDEr change pairs'] == '20.0'


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
  assert sorted(ablation_table.LABELS) == sorted(ablations.VARIANTS)


def test_goals_state_met_or_missed_with_numbers():
  full = [_run(1.60, 1.70, seed=0, decision=0.90, type=0.95, attributes=0.6,
               color__new_value=0.9),
          _run(1.50, 1.10, seed=1, decision=0.88, type=0.91, attributes=0.7,
               color__new_value=0.8)]
  duda = [_run(1.0, 1.0, seed=0, type=0.97), _run(1.0, 1.2, seed=1, type=0.93)]
  no_queries = [_run(1.0, 1.80, seed=0), _run(1.0, 1.20, seed=1)]
  no_stage1 = [_run(1.0, 1.00, seed=0), _run(1.0, 1.00, seed=1)]
  oracle = [_run(1.0, 1.80, seed=0), _run(1.0, 1.20, seed=1)]
  k1, k4 = [_run(1.0, 1.2, seed=0)], [_run(1.0, 1.5, seed=1)]
  text = ablation_table.goals({'k2': full, 'duda_patches': duda, 'no_queries': no_queries,
                               'no_stage1': no_stage1, 'oracle': oracle, 'k1': k1, 'k4': k4})
  lines = text.splitlines()
  # The runs' semantic decision (89 %), not the older change_decision (50 %).
  assert lines[:8] == [
      '- change / no-change decision >= 88 % (acceptance line): met (89.0 %)',
      '- change-pair CIDEr >= 110 (acceptance line): met (140.0)',
      '- change / no-change decision >= 90 %: missed (89.0 %)',
      '- change type >= 90 %: met (93.0 %)',
      '- all named attributes right >= 70 %: missed (65.0 %)',
      '- new colour right >= 80 % of colour changes: met (85.0 %)',
      '- change-pair CIDEr >= 150: missed (140.0)',
      '- CIDEr >= 150: met (155.0)']
  # Per-seed differences, full minus DUDA: change-pair CIDEr 70, -10; type -2, -2.
  duda_cider = next(x for x in lines if 'DUDA' in x and 'change-pair CIDEr' in x)
  duda_type = next(x for x in lines if 'DUDA' in x and 'change type' in x)
  assert ': holds' in duda_cider and '+30.0 ± 56.6 CIDEr over 2 seeds' in duda_cider
  assert 'does not hold' in duda_type and '-2.0 ± 0.0 points over 2 seeds' in duda_type
  # The orderings on change-pair CIDEr: no_queries above full on both seeds, no_stage1 below.
  nq_line = next(x for x in lines if x.startswith('- stage 1, no queries'))
  assert 'does not hold' in nq_line and '-10.0 ± 0.0 CIDEr' in nq_line
  ns_line = next(x for x in lines if x.startswith('- queries without stage 1'))
  assert ': holds' in ns_line and '+40.0 ± 42.4 CIDEr' in ns_line
  assert 'k 1 = 120.0, 2 = 140.0, 4 = 150.0; best k = 4' in text
  assert ('- oracle keyframes minus flow keyframes (k = 2) on change-pair CIDEr: +10.0 ± 0.0 '
          'CIDEr over 2 seeds') in lines
  assert 'static' not in text and 'faithful' not in text  # not run: no line
  assert 'not run' in ablation_table.goals({'static': no_stage1})
  # A run that predates a score says so instead of a number.
  assert ('- new colour right >= 80 % of colour changes: not measured (the runs predate this '
          'score)') in ablation_table.goals({'k2': [_run(1.0, 1.0)]}).splitlines()


@pytest.mark.parametrize('static_change, verdict', [((1.35, 0.75), 'does not hold'),
                                                    ((0.75, 0.15), 'holds')])
def test_full_beats_static_by_more_than_twice_the_seeds_spread(static_change, verdict):
  # Full's change-pair CIDEr over its seeds: 170, 110 -> sample std 42.4, threshold 84.9. Full
  # minus static is 35 on both seeds (ahead at every seed, by less than 84.9), then 95 on both.
  full = [_run(1.0, 1.70, seed=0), _run(1.0, 1.10, seed=1)]
  static = [_run(1.0, c, seed=s) for s, c in enumerate(static_change)]
  line = next(x for x in ablation_table.goals({'k2': full, 'static': static}).splitlines()
              if 'static' in x)
  assert line.startswith(f"- full >= {ablation_table.LABELS['static']} on change-pair CIDEr by "
                         f"more than twice the seeds' spread: {verdict} (")
  diff = 35.0 if verdict == 'does not hold' else 95.0
  assert f'full minus it: +{diff:.1f} ± 0.0 CIDEr over 2 seeds' in line
  assert line.endswith('2 x the std of full over its 2 seeds: 84.9)')


def test_decision_and_type_columns():
  runs = [_run(0.4, 0.6, decision=0.6), _run(0.6, 0.8, seed=1, decision=0.7)]
  row = next(r for r in ablation_table.table({'k2': runs}).splitlines()
             if r.startswith('| full'))
  assert '65.0 ± 7.1' in row
  typed = next(r for r in ablation_table.by_type({'k2': runs}).splitlines()
               if r.startswith('| full'))
  assert '70.0 ± 14.1' in typed and '| n/a |' in typed  # 'none' CIDEr absent in these runs


def test_change_type_right_by_change_type_table():
  def typed(seed, color, move):
    return _run(1.0, 1.0, seed=seed, color__type=color, material__type=0.5, add__type=1.0,
                drop__type=0.9, move__type=move)
  runs = {'k2': [typed(0, 0.4, 0.9), typed(1, 0.6, 0.7)], 'duda_patches': [typed(0, 0.1, 0.2)]}
  _, metric, types = ablation_table.TYPE_TABLES[1]
  text = ablation_table.by_type(runs, metric, types)
  assert text.splitlines()[0] == '| variant | color | material | add | drop | move |'
  assert _columns(text, 'full, k = 2') == {
      'variant': 'full, k = 2 (default)', 'color': '50.0 ± 14.1', 'material': '50.0 ± 0.0',
      'add': '100.0 ± 0.0', 'drop': '90.0 ± 0.0', 'move': '80.0 ± 14.1'}
  assert _columns(text, 'DUDA')['move'] == '20.0'
  report = ablation_table.report(runs)
  cider_at = report.index('CIDEr by change type (mean ± std over seeds):')
  type_at = report.index('Change type right % by change type')
  goals_at = report.index('Goals (full ProCap, k = 2; mean of the seeds):')
  assert cider_at < type_at < goals_at and text in report


def test_attribute_table_names_the_blind_guess_of_each_attribute():
  # One column per attribute of the changed object: a captioner that names shapes at the blind
  # guess (33.3 % of 3 shapes) is told apart from one that sees them.
  runs = {'k2': [_run(1.0, 1.0, size=0.8, color=0.6, material=0.7, shape=0.3),
                 _run(1.0, 1.0, seed=1, size=0.9, color=0.6, material=0.9, shape=0.4)]}
  title, metric, attributes = ablation_table.TYPE_TABLES[2]
  assert 'size 50.0, color 12.5, material 50.0, shape 33.3 %' in title
  text = ablation_table.by_type(runs, metric, attributes)
  assert _columns(text, 'full, k = 2') == {
      'variant': 'full, k = 2 (default)', 'size': '85.0 ± 7.1', 'color': '60.0 ± 0.0',
      'material': '80.0 ± 14.1', 'shape': '35.0 ± 7.1'}
  report = ablation_table.report(runs)
  assert report.index('Change type right % by change type') < report.index(title) < \
      report.index('Goals (full ProCap')


def test_reference_rows_follow_the_variants_with_their_numbers():
  references = {
      'no_change_constant': {'captioner': '"the scene is the same as before" for every pair',
                             'metrics': {'CIDEr': 0.862, 'change/CIDEr': 0.008, 'Bleu_4': 0.25,
                                         'semantic/decision': 0.5, 'semantic/type': 0.0}},
      'template_oracle': {'captioner': 'the truth | the ceiling',
                          'metrics': {'CIDEr': 4.641, 'change/CIDEr': 6.942,
                                      'semantic/decision': 1.0, 'semantic/type': 1.0,
                                      'semantic/color/new_value': 1.0}}}
  full = [_run(1.0, 1.0), _run(1.0, 1.0, seed=1)]
  full[1]['reference_rows'] = references  # the first run that has them
  text = ablation_table.table({'static': [_run(0.5, 0.5)], 'k2': full,
                               'duda_patches': [_run(0.3, 0.2)]})
  lines = text.splitlines()
  constant = _columns(text, 'reference: "the scene is the same as before"')
  assert constant['seeds'] == '-' and constant['CIDEr'] == '86.2'
  assert constant['CIDEr change pairs'] == '0.8' and constant['Bleu_4'] == '25.0'
  assert constant['METEOR'] == 'n/a' and constant['change / no-change decision %'] == '50.0'
  assert constant['distinct test captions per seed'] == '1'
  oracle = _columns(text, 'reference: the truth')
  assert oracle['variant'] == 'reference: the truth \\| the ceiling'
  assert oracle['CIDEr'] == '464.1' and oracle['CIDEr change pairs'] == '694.2'
  assert oracle['new colour right %'] == '100.0' and oracle['change type %'] == '100.0'
  assert oracle['distinct test captions per seed'] == '-'
  # After every variant row, in the runs' order.
  duda_at = next(i for i, r in enumerate(lines) if r.startswith('| DUDA'))
  ref_at = [i for i, r in enumerate(lines) if r.startswith('| reference: ')]
  assert len(ref_at) == 2 and duda_at < ref_at[0] and lines[ref_at[0]].startswith('| reference: "')
  assert 'reference:' not in ablation_table.table({'k2': [_run(1.0, 1.0)]})


class _FakeProc:
  """A child process that ends after `polls` polls with `code`, and records what it ran."""

  def __init__(self, cmd, log, events, polls=2, code=0):
    self.cmd, self.events, self.polls, self.code, self.returncode = cmd, events, polls, code, None
    self.task = (cmd[cmd.index('--variants') + 1], int(cmd[cmd.index('--seeds') + 1]))
    events.append(('start', self.task))
    log.write('=== started\n')

  def poll(self):
    self.polls -= 1
    if self.polls <= 0 and self.returncode is None:
      self.returncode = self.code
      self.events.append(('end', self.task))
    return self.returncode


def test_jobs_take_runs_in_order_and_a_follower_waits_for_its_stage1_source(tmp_path,
                                                                            monkeypatch):
  monkeypatch.setattr(ablations, '_shared_inputs_ready', lambda *a, **k: True)
  (tmp_path / 'static_s1').mkdir()
  (tmp_path / 'static_s1' / 'results.json').write_text('{}')  # finished: not started again
  events, running = [], []

  def spawn(cmd, stdout, stderr, env):
    assert '--xla_cpu_multi_thread_eigen=false' in env['XLA_FLAGS']
    proc = _FakeProc(cmd, stdout, events, polls=3 if '0' == cmd[cmd.index('--seeds') + 1] else 1)
    running.append(proc)
    assert sum(p.returncode is None for p in running) <= 2
    return proc

  args = argparse.Namespace(root=str(tmp_path), preset='ablation', override=[], data_dir='',
                            tokenizer_from='', tokenizer_per_seed=False, jobs=2)
  ablations._run_jobs(args, ['--root', str(tmp_path), '--seeds', '0,1', '--jobs', '2'], [0, 1],
                      ['static', 'no_queries', 'k2'], spawn=spawn, poll_seconds=0)
  starts = [t for kind, t in events if kind == 'start']
  assert starts[:2] == [('k2', 0), ('k2', 1)]  # the full model's seeds first, side by side
  assert sorted(starts) == sorted([('k2', 0), ('k2', 1), ('no_queries', 0), ('no_queries', 1),
                                   ('static', 0)])
  for seed in (0, 1):  # no_queries copies k2's stage 1 of its seed: only after that run ended
    assert events.index(('end', ('k2', seed))) < events.index(('start', ('no_queries', seed)))
  # k2 seed 0 runs longer, so the job k2 seed 1 freed went on with the next run it could start.
  assert events.index(('start', ('static', 0))) < events.index(('end', ('k2', 0)))
  assert (tmp_path / 'k2_s1.log').read_text().startswith('=== started')


def test_a_failed_run_fails_the_call_after_the_others_ran(tmp_path, monkeypatch):
  monkeypatch.setattr(ablations, '_shared_inputs_ready', lambda *a, **k: True)
  events = []
  spawn = lambda cmd, stdout, stderr, env: _FakeProc(  # noqa: E731
      cmd, stdout, events, code=int('static' in cmd))
  args = argparse.Namespace(root=str(tmp_path), preset='ablation', override=[], data_dir='',
                            tokenizer_from='', tokenizer_per_seed=False, jobs=2)
  with pytest.raises(errors.UserError, match=r'failed: static seed 0 \(log .*static_s0.log'):
    ablations._run_jobs(args, [], [0], ['static', 'k1', 'k4'], spawn=spawn, poll_seconds=0)
  assert sorted(t for kind, t in events if kind == 'end') == [('k1', 0), ('k4', 0), ('static', 0)]


def test_child_argv_drops_the_per_job_options_in_both_forms():
  argv = ['--root', 'R', '--jobs', '2', '--variants=k2,k4', '--out', 'x.md', '--seeds', '0,1',
          '--override', 'caption.train.steps=5', '--core=1', '--figure=x.png']
  assert ablations.child_argv(argv) == ['--root', 'R', '--override', 'caption.train.steps=5']


def test_duda_run_copies_no_tokenizer_and_returns_the_reference_rows(tmp_path, monkeypatch):
  root = tmp_path / 'abl'
  (root / 'tokenizer').mkdir(parents=True)
  (root / 'tokenizer' / 'DONE').write_text('{}')
  stages = {}

  def fake_run(config, workdir):
    stages[os.path.basename(workdir)] = tuple(config.stages)
    return {'metrics': {'CIDEr': 1.0}, 'reference_rows': {'template_oracle': {'metrics': {}}}}

  monkeypatch.setattr(ablations.main_lib, 'run', fake_run)
  results = ablations.run_variant('duda_patches', 0, str(root), 'ablation', [])
  assert stages['duda_patches_s0'] == ('caption',)
  assert not (root / 'duda_patches_s0' / 'tokenizer').exists()
  assert results['reference_rows'] == {'template_oracle': {'metrics': {}}}
  ablations.run_variant('static', 0, str(root), 'ablation', [])  # a tokenizer stage: copied
  assert 'tokenizer' in stages['static_s0'] and (root / 'static_s0' / 'tokenizer' / 'DONE').exists()


class _Started(Exception):
  pass


def test_duda_is_never_the_run_that_builds_the_shared_inputs(tmp_path, monkeypatch):
  assert ablations.first_run(list(ablations.VARIANTS), 'ablation', []) != 'duda_patches'
  assert ablations.first_run(['duda_patches'], 'ablation', []) == 'duda_patches'  # data alone
  # Not by its place in RUN_ORDER alone: first there, it still is not the first run.
  monkeypatch.setattr(ablations, 'RUN_ORDER', ('duda_patches', 'k4', 'static'))
  assert ablations.first_run(['static', 'duda_patches', 'k4'], 'ablation', []) == 'k4'
  started = []

  def fake_run_variant(variant, seed, *args, **kwargs):
    started.append((variant, seed))
    raise _Started  # before any job process starts

  monkeypatch.setattr(ablations, 'run_variant', fake_run_variant)
  args = argparse.Namespace(root=str(tmp_path / 'abl'), preset='ablation', override=[],
                            data_dir='', tokenizer_from='', tokenizer_per_seed=False, jobs=2)
  with pytest.raises(_Started):
    ablations._run_jobs(  # pylint: disable=protected-access
        args, [], [3, 4], ['duda_patches', 'k4'])
  assert started == [('k4', 3)]
  # Only duda_patches: a built dataset is all the jobs share (no tokenizer is waited for).
  monkeypatch.setattr(ablations.datasets, 'is_prepared', lambda *unused: True)
  ready = ablations._shared_inputs_ready  # pylint: disable=protected-access
  assert ready(args, 3, tokenizer=False) and not ready(args, 3)


def test_report_only_reads_finished_runs_and_names_the_missing(tmp_path):
  root = tmp_path / 'abl'
  for variant, seed, cider in (('k2', 0, 0.7), ('k2', 1, 0.5), ('static', 0, 0.6)):
    run = root / f'{variant}_s{seed}'
    (run / 'caption').mkdir(parents=True)
    results = _run(cider, cider, seed=seed)
    results['reference_rows'] = {'change_constant': {'captioner': 'one sentence',
                                                     'metrics': {'CIDEr': 0.44}}}
    (run / 'results.json').write_text(json.dumps(results))
    (run / 'config.json').write_text(json.dumps({'seed': seed}))
    (run / 'caption' / 'predictions_test.json').write_text(json.dumps(
        [{'image_id': 1, 'caption': 'a'}, {'image_id': 2, 'caption': 'b'}]))
  out = tmp_path / 'results.md'
  ablations.main(['--root', str(root), '--seeds', '0,1', '--variants', 'static,k2',
                  '--report_only', '--out', str(out)])
  text = out.read_text()
  assert 'not finished yet: static (seed 1).' in text and '--report_only' not in text.split(';')[0]
  k2_row = next(r for r in text.splitlines() if r.startswith('| full, k = 2'))
  assert '| 2 |' in k2_row and '60.0 ± 14.1' in k2_row and '| 2, 2 |' in k2_row
  assert any(r.startswith('| reference: one sentence | - | ') and '| 44.0 |' in r
             for r in text.splitlines())
  assert 'Goals (full ProCap, k = 2; mean of the seeds):' in text
  assert not (root / 'static_s1').exists()  # nothing trained
  assert '![The table as a picture' in text and '(ablations.png)' in text
  with PIL.Image.open(tmp_path / 'ablations.png') as im:
    assert im.format == 'PNG' and im.width > im.height
  # With a ledger, the runs' maker is the training call's command line, with the time it took.
  (root / ablation_clock.FILE).write_text(json.dumps(
      {'calls': 2, 'seconds': 7200.0, 'runs': {'k2_s0': 3000.0, 'k2_s1': 3600.0},
       'command': 'python -m procap_jax.ablations --root R --jobs 2'}))
  ablations.main(['--root', str(root), '--seeds', '0,1', '--variants', 'static,k2',
                  '--report_only', '--out', str(out)])
  text = out.read_text()
  assert 'Runs made by `python -m procap_jax.ablations --root R --jobs 2`;' in text
  assert 'Time: 2 calls of it trained for 2.0 h of wall time in all; minutes per run' in text
  assert 'k2 55' in text


def test_semantic_columns_beside_cider():
  runs = [_run(0.4, 0.6, decision=0.6), _run(0.6, 0.8, seed=1, decision=0.7)]
  for r, (decision, kind, attrs, colour) in zip(runs, ((0.9, 0.8, 0.5, 0.2),
                                                       (0.7, 0.6, 0.3, 0.4))):
    r['metrics'].update({'semantic/decision': decision, 'semantic/type': kind,
                         'semantic/attributes': attrs, 'semantic/color/new_value': colour})
  got = _columns(ablation_table.table({'k2': runs}), 'full')
  assert got['CIDEr'] == '50.0 ± 14.1' and got['CIDEr change pairs'] == '70.0 ± 14.1'
  # The semantic decision, not the older change_decision (60, 70), when a run has both.
  assert got['change / no-change decision %'] == '80.0 ± 14.1'
  assert got['change type %'] == '70.0 ± 14.1' and got['all named attributes %'] == '40.0 ± 14.1'
  assert got['new colour right %'] == '30.0 ± 14.1'


def test_figure_scores_are_the_tables_seeds_in_its_order_and_nothing_is_drawn_without_runs(
    tmp_path):
  nan = float('nan')
  runs = {'k2': [_run(0.5, 1.2, decision=0.9), _run(0.5, nan, seed=1), _run(0.5, 1.0, seed=2)],
          'static': [_run(0.4, 0.8)], 'k4': []}
  assert ablation_plot.seed_scores(runs, 'change/CIDEr') == {'static': [80.0],
                                                              'k2': [120.0, 100.0]}
  # A run whose results predate the semantic decision is drawn with its change_decision.
  assert ablation_plot.seed_scores(runs, 'semantic/decision')['k2'] == [90.0, 50.0, 50.0]
  assert not ablation_plot.plot({'k2': []}, str(tmp_path / 'none.png'))
  assert not (tmp_path / 'none.png').exists()
  assert ablation_plot.plot(runs, str(tmp_path / 'some.png'))
  assert (tmp_path / 'some.png').stat().st_size > 1000


def test_runs_go_variant_by_variant_with_the_full_model_first(tmp_path, monkeypatch):
  calls = []

  def fake_run_variant(variant, seed, *args, **kwargs):
    calls.append((variant, seed))
    return _run(0.5, 0.5, seed=seed)

  monkeypatch.setattr(ablations, 'run_variant', fake_run_variant)
  monkeypatch.setattr(ablation_plot, 'plot', lambda *a: False)
  ablations.main(['--root', str(tmp_path), '--seeds', '0,1', '--variants', 'static,no_queries,k2',
                  '--out', str(tmp_path / 'r.md')])
  assert calls == [('k2', 0), ('k2', 1), ('no_queries', 0), ('no_queries', 1), ('static', 0),
                   ('static', 1)]


def test_the_clock_reads_each_variant_back_from_its_run_name():
  # The ledger keys runs by name and groups them by variant: every variant, underscores and
  # all ('no_stage1', 'duda_patches'), comes back whole, at any seed.
  for variant in ablations.VARIANTS:
    for seed in (0, 2, 13):
      assert ablation_clock.variant_of(ablations.run_name(variant, seed)) == variant


def test_the_clock_sums_the_calls_and_each_runs_time_over_resumed_calls(tmp_path):
  now = [100.0]
  first = ablation_clock.Clock(str(tmp_path), 'python -m procap_jax.ablations --jobs 2',
                                now=lambda: now[0])
  now[0] += 60
  first.tick(['k2_s0', 'k2_s1'])
  now[0] += 30  # killed here: these 30 s were never ticked
  second = ablation_clock.Clock(str(tmp_path), now=lambda: now[0])  # the resumed call
  now[0] += 120
  second.tick(['k2_s0'])
  data = ablation_clock.read(str(tmp_path))
  assert data == {'calls': 2, 'seconds': 180.0, 'runs': {'k2_s0': 180.0, 'k2_s1': 60.0},
                  'command': 'python -m procap_jax.ablations --jobs 2'}
  text = ablation_clock.describe(data, this_call_minutes=2.0, finished={'k2_s0', 'k2_s1'})
  assert text.startswith('2 calls of it trained for 0.1 h of wall time in all')
  assert 'this call took 2 min' in text and 'k2 2' in text  # (180 + 60) / 2 s = 2 min
  # A run not finished yet (k2_s1 here) is not in the minutes per run.
  assert 'k2 3' in ablation_clock.describe(data, None, finished={'k2_s0'})


def test_a_corrupt_clock_is_one_error_sentence(tmp_path):
  (tmp_path / ablation_clock.FILE).write_text('{"calls": 1}')
  with pytest.raises(errors.UserError, match='not a wall-clock ledger'):
    ablation_clock.Clock(str(tmp_path))


def test_the_jobs_loop_ticks_its_runs_and_its_children_keep_no_clock(tmp_path, monkeypatch):
  monkeypatch.setattr(ablations, '_shared_inputs_ready', lambda *a, **k: True)
  events, commands = [], []

  def spawn(cmd, stdout, stderr, env):
    commands.append(cmd)
    return _FakeProc(cmd, stdout, events, polls=3 if 'k1' in cmd else 1)

  args = argparse.Namespace(root=str(tmp_path), preset='ablation', override=[], data_dir='',
                            tokenizer_from='', tokenizer_per_seed=False, jobs=2)
  now = [0.0]

  def later():
    now[0] += 10.0
    return now[0]

  clock = ablation_clock.Clock(str(tmp_path), now=later)
  ablations._run_jobs(args, [], [0], ['k1', 'k4'], spawn=spawn, poll_seconds=0, clock=clock)
  assert all('--job' in cmd for cmd in commands)
  runs = ablation_clock.read(str(tmp_path))['runs']
  assert set(runs) == {'k1_s0', 'k4_s0'} and runs['k1_s0'] > runs['k4_s0'] > 0
  # A job process (--job) trains its run but adds no call to the ledger: its parent counts it.
  monkeypatch.setattr(ablations, 'run_variant', lambda *a, **k: _run(0.5, 0.5))
  ablations.main(['--root', str(tmp_path), '--variants', 'k4', '--seeds', '0', '--job',
                  '--out', str(tmp_path / 'job0.md')])
  assert ablation_clock.read(str(tmp_path))['calls'] == 1
