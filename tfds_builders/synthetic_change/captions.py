"""Caption templates in CLEVR-Change style, with full attribute phrases.

Every pair keeps all paraphrases of its change type (the loader samples one for training; val
and test use all of them as references). Words only, lowercase, no punctuation.
"""

from tfds_builders.synthetic_change import scene

# {obj}: the object's full phrase ("the small red metal cube"); {new}: the new colour or
# material; {what}: the phrase without its article ("small red metal cube").
TEMPLATES: dict[str, tuple[str, ...]] = {
    'none': (
        'there is no change',
        'nothing has changed',
        'the scene is the same as before',
        'no change was made',
        'the two scenes seem identical',
        'there is no difference',
        'the scene remains the same',
    ),
    'color': (
        '{obj} changed to {new}',
        '{obj} turned {new}',
        '{obj} became {new}',
        '{obj} changed its color to {new}',
        '{obj} is now {new}',
        '{obj} was painted {new}',
    ),
    'material': (
        '{obj} became {new}',
        '{obj} turned {new}',
        '{obj} changed to {new}',
        '{obj} is now {new}',
        '{obj} is now made of {new}',
        '{obj} changed its material to {new}',
    ),
    'add': (
        '{obj} has been newly placed',
        '{obj} has been added',
        '{obj} has appeared',
        'someone added {obj}',
        'there is a new {what}',
        '{obj} was added to the scene',
    ),
    'drop': (
        '{obj} is no longer there',
        '{obj} has disappeared',
        '{obj} is missing',
        '{obj} has been removed',
        '{obj} is gone',
        'someone removed {obj}',
    ),
    'move': (
        '{obj} moved',
        '{obj} has been moved',
        '{obj} changed its location',
        '{obj} is in a different location',
        'someone moved {obj}',
        '{obj} moved to a new position',
    ),
}


def phrase(obj: scene.Object) -> str:
  """The full attribute phrase without article: size, colour, material, shape."""
  return f'{obj.size} {obj.color} {obj.material} {obj.shape}'


def subject(pair: scene.Pair) -> scene.Object | None:
  """The object a caption of `pair` names: the added one, else the changed one (before the
  change); None for a no-change pair."""
  if pair.change_type == 'none':
    return None
  return pair.changed if pair.change_type == 'add' else pair.objects[pair.target]


def captions(pair: scene.Pair) -> list[str]:
  """All reference captions of a pair (one per template of its change type)."""
  if pair.change_type == 'none':
    return list(TEMPLATES['none'])
  new = ''
  if pair.change_type == 'color':
    new = pair.changed.color
  elif pair.change_type == 'material':
    new = pair.changed.material
  what = phrase(subject(pair))
  return [t.format(obj=f'the {what}', what=what, new=new) for t in TEMPLATES[pair.change_type]]
