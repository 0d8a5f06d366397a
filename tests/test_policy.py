"""The scoring forward (troll/policy.py): the chunked output layer is the same distribution as the full logits."""

import pytest
import torch

from troll import addition
from troll.head import LMHead
from troll.policy import completion_logits
from troll.tiny import tiny_llama, train_tokenizer


@pytest.mark.parametrize("tied", [True, False])
def test_head_form_equals_full_logits(tied):
    tok = train_tokenizer(addition.corpus(), vocab_size=64)
    model = tiny_llama(tok, hidden=32, layers=1, heads=2, seed=0)
    if tied:
        model.lm_head.weight = model.get_input_embeddings().weight
    assert (model.lm_head.weight is model.get_input_embeddings().weight) == tied
    prompts = [tok.encode("12+34="), tok.encode("5+7=")]
    completions = torch.tensor([[tok.encode("4")[0], tok.encode("6")[0], 0], [tok.encode("1")[0], 0, 0]])
    vocab = len(tok) - 3  # pretend the output layer is padded past the tokenizer: those ids are masked
    full = completion_logits(model, prompts, completions, 0.7, vocab)
    head = completion_logits(model, prompts, completions, 0.7, vocab, chunk_rows=2)
    assert isinstance(head, LMHead) and head.hidden.shape == (*full.shape[:2], 32)
    torch.testing.assert_close(head.reshape(-1, full.shape[-1]).logits(), full.reshape(-1, full.shape[-1]))
    assert (full[..., vocab:] == -torch.inf).all()


def test_head_form_refuses_a_model_with_soft_capping():
    tok = train_tokenizer(addition.corpus(), vocab_size=64)
    model = tiny_llama(tok, hidden=32, layers=1, heads=2, seed=0)
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        completion_logits(model, [tok.encode("1+1=")], torch.zeros(1, 2, dtype=torch.long), 1.0, len(tok), 4)
