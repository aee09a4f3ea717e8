"""attnx.data.synthetic_translation: alignments, vocabularies, the rule-based translator."""

import numpy as np

import attnx.data as D
from attnx.data import synthetic_translation as st


def test_synthetic_translation_alignment_and_vocab(data_dir):
  info = D.get_info("synthetic_translation")
  assert info.extras["source_vocab"][:3] == ["<pad>", "<bos>", "<eos>"]
  assert len(info.extras["target_vocab"]) == info.target_vocab_size
  data = D.load_arrays("synthetic_translation", "test", data_dir=data_dir, config="tiny")
  verbs = {e: row for row in st.VERBS for e in row[:2]}
  nonmonotonic = 0
  for x, y, a in zip(data["inputs"], data["targets"], data["alignment"], strict=True):
    src, tgt = st.decode(x, st.SOURCE_VOCAB), st.decode(y, st.TARGET_VOCAB)
    assert 3 <= len(src) == len(tgt) <= 7
    align = a[: len(tgt)]
    assert sorted(align.tolist()) == list(range(len(src)))  # a permutation (1:1 words)
    assert a[len(tgt)] == len(src)  # EOS <-> EOS
    nonmonotonic += bool((np.diff(align) < 0).any())
    # SOV: the last target word is the conjugated source verb.
    src_verb = src[align[-1]]
    assert tgt[-1] in verbs[src_verb][2:]
  assert nonmonotonic == len(data["inputs"])  # the verb always moves to the end


def test_synthetic_translation_examples():
  import random

  assert st.translate("i love you") == (["je", "te", "aime"], [0, 2, 1])
  assert st.translate("the big apples see a cat")[0] == "les pommes grandes un chat voient".split()
  assert st.translate("she eats some old flowers")[0] == "elle des fleurs vieilles mange".split()
  assert st.translate("we find him")[0] == "nous le trouvons".split()
  rng = random.Random(0)
  for _ in range(500):  # the sampler agrees with the independent rule-based translator
    src, tgt, align = st.make_sentence(rng)
    assert st.translate(src) == (tgt, align)


def test_example_arrays_for_hand_picked_sentences():
  src, tgt_in, sw, tw = st.example_arrays(["i love you"])
  assert sw == [["i", "love", "you", "<eos>"]] and tw == [["je", "te", "aime", "<eos>"]]
  assert src.shape == tgt_in.shape == (1, st.SEQ_LEN)
  assert st.decode(src[0], st.SOURCE_VOCAB) == ["i", "love", "you"]
  assert tgt_in[0, 0] == st.BOS_ID  # teacher forcing: the target shifted right
