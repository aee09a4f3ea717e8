"""Synthetic translation: English-like SVO -> French-like SOV with agreement.

A toy grammar whose alignments are non-monotonic, for labelled attention
heatmaps (cf. the Wikipedia article "Attention (machine learning)", "I love you" -> "je t'aime"):

  source (SVO): SUBJ VERB OBJ,  NP = DET [ADJ] NOUN
  target (SOV): SUBJ OBJ VERB,  NP = DET NOUN [ADJ]

Subjects and objects are pronouns with probability p_pronoun, else noun
phrases (singular or plural, with an adjective with probability
p_adjective). Agreement: English verbs take -s with third-person singular
subjects; target verbs are conjugated by person and number, target
determiners and adjectives agree with the noun's gender and number
("the big apples" -> "les pommes grandes"), object pronouns move before the
verb ("i love you" -> "je te aime").

Ids: PAD=0, BOS=1, EOS=2, then words (`SOURCE_VOCAB` / `TARGET_VOCAB`, id ->
word). Sequences hold at most 7 words + EOS, padded to SEQ_LEN = 8:

  inputs [8], targets [8], decoder_inputs [8] (BOS + targets[:-1]),
  mask [8] (targets != PAD), alignment [8] (source position of the word
  each target token translates, EOS -> source EOS, -1 at padding).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Mapping, Sequence

import numpy as np

from attnx.data._base import AttnxBuilder, AttnxConfig, DatasetInfo, bool_tensor, int_tensor
from attnx.data.copy_reverse_sort import BOS_ID, EOS_ID, PAD_ID, shift_right

SEQ_LEN = 8
SPECIALS = ("<pad>", "<bos>", "<eos>")

# (person, number) -> (english subject, english object, target subject, target object)
PRONOUNS = {
  (1, "sg"): ("i", "me", "je", "me"),
  (2, "sg"): ("you", "you", "tu", "te"),
  (3, "sg_m"): ("he", "him", "il", "le"),
  (3, "sg_f"): ("she", "her", "elle", "la"),
  (1, "pl"): ("we", "us", "nous", "nous"),
  (3, "pl"): ("they", "them", "ils", "les"),
}
# english sg, english pl, target sg, target pl, gender
NOUNS = (
  ("cat", "cats", "chat", "chats", "m"),
  ("dog", "dogs", "chien", "chiens", "m"),
  ("bird", "birds", "oiseau", "oiseaux", "m"),
  ("child", "children", "enfant", "enfants", "m"),
  ("book", "books", "livre", "livres", "m"),
  ("apple", "apples", "pomme", "pommes", "f"),
  ("ball", "balls", "balle", "balles", "f"),
  ("house", "houses", "maison", "maisons", "f"),
  ("flower", "flowers", "fleur", "fleurs", "f"),
  ("girl", "girls", "fille", "filles", "f"),
)
# english, target m.sg, f.sg, m.pl, f.pl
ADJECTIVES = (
  ("big", "grand", "grande", "grands", "grandes"),
  ("small", "petit", "petite", "petits", "petites"),
  ("red", "rouge", "rouge", "rouges", "rouges"),
  ("old", "vieux", "vieille", "vieux", "vieilles"),
  ("happy", "heureux", "heureuse", "heureux", "heureuses"),
  ("green", "vert", "verte", "verts", "vertes"),
)
# english base, english 3sg, target 1sg 2sg 3sg 1pl 2pl 3pl
VERBS = (
  ("see", "sees", "vois", "vois", "voit", "voyons", "voyez", "voient"),
  ("love", "loves", "aime", "aimes", "aime", "aimons", "aimez", "aiment"),
  ("eat", "eats", "mange", "manges", "mange", "mangeons", "mangez", "mangent"),
  ("find", "finds", "trouve", "trouves", "trouve", "trouvons", "trouvez", "trouvent"),
  ("take", "takes", "prends", "prends", "prend", "prenons", "prenez", "prennent"),
  ("want", "wants", "veux", "veux", "veut", "voulons", "voulez", "veulent"),
)
# english determiner -> (number, target by gender)
DETERMINERS = {
  ("the", "sg"): {"m": "le", "f": "la"},
  ("a", "sg"): {"m": "un", "f": "une"},
  ("the", "pl"): {"m": "les", "f": "les"},
  ("some", "pl"): {"m": "des", "f": "des"},
}


def _build_vocabs() -> tuple[tuple[str, ...], tuple[str, ...]]:
  src, tgt = [], []
  for es, eo, ts, to in PRONOUNS.values():
    src += [es, eo]
    tgt += [ts, to]
  for (det, _), by_gender in DETERMINERS.items():
    src.append(det)
    tgt += list(by_gender.values())
  for es, ep, ts, tp, _ in NOUNS:
    src += [es, ep]
    tgt += [ts, tp]
  for e, *forms in ADJECTIVES:
    src.append(e)
    tgt += forms
  for e, e3, *forms in VERBS:
    src += [e, e3]
    tgt += forms
  return SPECIALS + tuple(dict.fromkeys(src)), SPECIALS + tuple(dict.fromkeys(tgt))


SOURCE_VOCAB, TARGET_VOCAB = _build_vocabs()
SOURCE_IDS = {w: i for i, w in enumerate(SOURCE_VOCAB)}
TARGET_IDS = {w: i for i, w in enumerate(TARGET_VOCAB)}


@dataclasses.dataclass(eq=False)
class SyntheticTranslationConfig(AttnxConfig):
  """Grammar probabilities and split sizes."""

  p_pronoun: float = 0.3
  p_adjective: float = 0.5
  num_train: int = 20000
  num_test: int = 1000

  def validate(self) -> None:
    if not (0 <= self.p_pronoun <= 1 and 0 <= self.p_adjective <= 1):
      raise ValueError("p_pronoun and p_adjective must be in [0, 1].")


def _phrase(rng: random.Random, role: int, p_pronoun: float, p_adjective: float):
  """A subject (role 0) or object (role 1): english words, target words with the
  index of the english word each translates, and (person, number)."""
  if rng.random() < p_pronoun:
    (person, number), forms = rng.choice(list(PRONOUNS.items()))
    return [forms[role]], [(forms[2 + role], 0)], (person, number[:2])
  es, ep, ts, tp, gender = rng.choice(NOUNS)
  number = rng.choice(("sg", "pl"))
  det = rng.choice([d for (d, num) in DETERMINERS if num == number])
  det_t = DETERMINERS[(det, number)][gender]
  src, tgt = [det], [(det_t, 0)]
  adj = rng.choice(ADJECTIVES) if rng.random() < p_adjective else None
  if adj is not None:
    src.append(adj[0])
  src.append(es if number == "sg" else ep)
  tgt.append((ts if number == "sg" else tp, len(src) - 1))
  if adj is not None:
    form = adj[1 + (gender == "f") + 2 * (number == "pl")]
    tgt.append((form, 1))  # target noun-adjective order: swapped alignment
  return src, tgt, (3, number)


def make_sentence(
  rng: random.Random, p_pronoun: float = 0.3, p_adjective: float = 0.5
) -> tuple[list[str], list[str], list[int]]:
  """(source words, target words, alignment target position -> source position)."""
  s_src, s_tgt, (person, number) = _phrase(rng, 0, p_pronoun, p_adjective)
  o_src, o_tgt, _ = _phrase(rng, 1, p_pronoun, p_adjective)
  verb = rng.choice(VERBS)
  third_sg = person == 3 and number == "sg"
  verb_src = verb[1] if third_sg else verb[0]
  verb_tgt = verb[2 + (person - 1) + 3 * (number == "pl")]
  src = s_src + [verb_src] + o_src
  v_pos, o_off = len(s_src), len(s_src) + 1
  tgt = [w for w, _ in s_tgt] + [w for w, _ in o_tgt] + [verb_tgt]
  align = [i for _, i in s_tgt] + [o_off + i for _, i in o_tgt] + [v_pos]
  return src, tgt, align


def translate(source: Sequence[str] | str) -> tuple[list[str], list[int]]:
  """Rule-based translation of a source sentence: (target words, alignment).

  A parser independent of the sampler, e.g. "i love you" -> "je te aime".
  """
  words = source.split() if isinstance(source, str) else list(source)
  subj_pron = {v[0]: (k, v) for k, v in PRONOUNS.items()}
  obj_pron = {v[1]: v for v in PRONOUNS.values()}
  nouns = {w: (row, i) for row in NOUNS for i, w in enumerate(row[:2])}
  adjs = {row[0]: row for row in ADJECTIVES}
  verbs = {w: row for row in VERBS for w in row[:2]}

  def noun_phrase(pos: int) -> tuple[list[tuple[str, int]], int, str]:
    det = words[pos]
    adj = adjs.get(words[pos + 1])
    noun_pos = pos + 1 + (adj is not None)
    row, plural = nouns[words[noun_pos]]
    number = "pl" if plural else "sg"
    gender = row[4]
    out = [(DETERMINERS[(det, number)][gender], pos), (row[2 + plural], noun_pos)]
    if adj is not None:
      out.append((adj[1 + (gender == "f") + 2 * plural], pos + 1))
    return out, noun_pos + 1, number

  if words[0] in subj_pron:
    (person, number), forms = subj_pron[words[0]]
    subj, pos, number = [(forms[2], 0)], 1, number[:2]
  else:
    subj, pos, number = noun_phrase(0)
    person = 3
  verb_pos = pos
  verb = verbs[words[verb_pos]][2 + (person - 1) + 3 * (number == "pl")]
  if words[pos + 1] in obj_pron:
    obj = [(obj_pron[words[pos + 1]][3], pos + 1)]
  else:
    obj, _, _ = noun_phrase(pos + 1)
  out = subj + obj + [(verb, verb_pos)]
  return [w for w, _ in out], [i for _, i in out]


def encode(words: Sequence[str], ids: Mapping[str, int], length: int = SEQ_LEN) -> np.ndarray:
  """Word ids + EOS, padded to `length`."""
  out = np.full((length,), PAD_ID, np.int32)
  out[: len(words)] = [ids[w] for w in words]
  out[len(words)] = EOS_ID
  return out


def decode(ids: Sequence[int] | np.ndarray, vocab: Sequence[str] = TARGET_VOCAB) -> list[str]:
  """Words up to (excluding) the first EOS, skipping PAD/BOS."""
  words = []
  for i in np.asarray(ids).reshape(-1):
    if int(i) == EOS_ID:
      break
    if int(i) not in (PAD_ID, BOS_ID):
      words.append(vocab[int(i)])
  return words


def example_arrays(sentences: Sequence[str]) -> tuple[np.ndarray, np.ndarray, list[list[str]],
                                                      list[list[str]]]:
  """Model inputs for hand-picked source sentences (e.g. "i love you"): source ids [B, L],
  teacher-forcing decoder inputs [B, L] of their translations, and the source and target
  words with ``"<eos>"`` (the axes of an alignment heat map)."""
  src, tgt_in, src_words, tgt_words = [], [], [], []
  for s in sentences:
    words = s.split()
    tw, _ = translate(words)
    src.append(encode(words, SOURCE_IDS))
    tgt_in.append(shift_right(encode(tw, TARGET_IDS)[None])[0])
    src_words.append(words + ["<eos>"])
    tgt_words.append(tw + ["<eos>"])
  return np.stack(src), np.stack(tgt_in), src_words, tgt_words


def make_synthetic_translation(
  n: int, seed: int, *, p_pronoun: float = 0.3, p_adjective: float = 0.5
) -> dict[str, np.ndarray]:
  """n sentence pairs (keys as in the module docstring)."""
  rng = random.Random(int(seed))
  inputs = np.zeros((n, SEQ_LEN), np.int32)
  targets = np.zeros((n, SEQ_LEN), np.int32)
  alignment = np.full((n, SEQ_LEN), -1, np.int32)
  for i in range(n):
    src, tgt, align = make_sentence(rng, p_pronoun, p_adjective)
    inputs[i] = encode(src, SOURCE_IDS)
    targets[i] = encode(tgt, TARGET_IDS)
    alignment[i, : len(align)] = align
    alignment[i, len(align)] = len(src)  # EOS <-> EOS
  return {
    "inputs": inputs,
    "targets": targets,
    "decoder_inputs": shift_right(targets),
    "mask": targets != PAD_ID,
    "alignment": alignment,
  }


class SyntheticTranslation(AttnxBuilder):
  """Toy SVO -> SOV translation with agreement."""

  BUILDER_CONFIGS = [
    SyntheticTranslationConfig(name="default", description="20k/1k sentence pairs."),
    SyntheticTranslationConfig(
      name="tiny", description="Small, for tests.", num_train=256, num_test=64
    ),
  ]

  @classmethod
  def _features(cls, config):
    t = (SEQ_LEN,)
    return {
      "inputs": int_tensor(t),
      "targets": int_tensor(t),
      "decoder_inputs": int_tensor(t),
      "mask": bool_tensor(t),
      "alignment": int_tensor(t),
    }

  @classmethod
  def _generate_split(cls, config, split, n, seed) -> Mapping[str, np.ndarray]:
    return make_synthetic_translation(
      n, seed, p_pronoun=config.p_pronoun, p_adjective=config.p_adjective
    )

  @classmethod
  def describe(cls, config) -> DatasetInfo:
    return DatasetInfo(
      name="synthetic_translation",
      task="seq2seq",
      input_shape=(SEQ_LEN,),
      input_dtype="int32",
      num_classes=len(TARGET_VOCAB),
      vocab_size=len(SOURCE_VOCAB),
      target_vocab_size=len(TARGET_VOCAB),
      seq_len=SEQ_LEN,
      splits=cls._split_sizes(config),
      description=__doc__.strip().splitlines()[0],
      extras={
        "source_vocab": list(SOURCE_VOCAB),
        "target_vocab": list(TARGET_VOCAB),
        "pad_id": PAD_ID,
        "bos_id": BOS_ID,
        "eos_id": EOS_ID,
        "params": config.params(),
      },
    )
