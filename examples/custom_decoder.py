"""A decoder of your own with DASH attention (the model of docs/models.md).

Not the built-in DashForCausalLM: its own parameter names, one fused q/k/v projection with
biases, LayerNorm, a GELU MLP, tied embeddings and a vision projection for image features.
It follows the dash-trt model contract (dash_trt.modeling.DashModel), so dash-export,
dash-compare, dash-build and dash-triton take it with --model examples/custom_decoder.py:TinyOCRDecoder.
"""

import torch
import torch.nn.functional as F
from torch import nn

from dash_trt.modeling import DashAttention, DashModel


class Block(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        h, eps = config.hidden_size, config.get("layer_norm_eps", 1e-5)
        self.heads, self.kv_heads, self.dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.ln_1 = nn.LayerNorm(h, eps=eps)
        self.qkv = nn.Linear(h, (self.heads + 2 * self.kv_heads) * self.dim, bias=True)
        # DASH's indexer: its query and key projections and the learned per-dimension weights
        self.index_q = nn.Linear(h, config.index_head_dim, bias=False)
        self.index_k = nn.Linear(h, config.index_head_dim, bias=False)
        self.index_weight = nn.Parameter(torch.zeros(config.index_head_dim))
        self.attn = DashAttention(config, layer_idx)  # the attention core: RoPE, routing, paged KV
        self.proj = nn.Linear(self.heads * self.dim, h, bias=True)
        self.ln_2 = nn.LayerNorm(h, eps=eps)
        self.fc_in = nn.Linear(h, config.intermediate_size)
        self.fc_out = nn.Linear(config.intermediate_size, h)

    def forward(self, x, dash):
        t = x.shape[0]
        y = self.ln_1(x)
        q, k, v = self.qkv(y).split([self.heads * self.dim, self.kv_heads * self.dim, self.kv_heads * self.dim], -1)
        out = self.attn(
            q.reshape(t, self.heads, self.dim),
            k.reshape(t, self.kv_heads, self.dim),
            v.reshape(t, self.kv_heads, self.dim),
            self.index_q(y),
            self.index_k(y),
            self.index_weight,
            dash,
        )
        x = x + self.proj(out.reshape(t, -1))
        return x + self.fc_out(F.gelu(self.fc_in(self.ln_2(x)), approximate="tanh"))


class TinyOCRDecoder(DashModel):
    def __init__(self, config):
        super().__init__(config)
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.num_hidden_layers))
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.get("layer_norm_eps", 1e-5))
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.head.weight = self.wte.weight
        if config.image_feature_dim is not None:  # the vision encoder's features -> hidden size
            self.vision_proj = nn.Linear(config.image_feature_dim, config.hidden_size)

    def embed_input_ids(self, input_ids):
        return self.wte(input_ids)

    def embed_image_features(self, features):
        return self.vision_proj(features)

    def forward(self, inputs_embeds, dash):
        x = inputs_embeds
        for block in self.blocks:
            x = block(x, dash)
        return x

    def compute_logits(self, hidden):
        return self.head(self.ln_f(hidden))
