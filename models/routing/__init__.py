"""Routing instrumentation: which experts every token used, recorded and replayed, and what routing is measured by.

Everything hooks the router module of each MoE block (transformers 5.x `*TopKRouter`, returning
`(router_logits, top_k_weights, top_k_indices)`), so it is independent of the experts backend. One module a job:

    trace.py        the trace (`RoutingTrace [L, B, S, K]`, `NO_ROUTE`) and where the routers are (`find_routers`)
    families.py     how each router family ranks and gates (softmax; sigmoid + selection bias)
    hooks.py        the router hooks, armed from one `RoutingRequest` per forward (`routing`): record, replay
                    (`ReplayRule`); and the captured router calls (`RouterCalls`)
    measures.py     what routing is measured by: drift between two traces, expert load, the margin at the top-k cut
    flips.py        SYNTHETIC drift in the forwards run inside a context (the flips)
    perturbation.py SYNTHETIC drift the policy carries (noise on the routers' weights)
    predictor.py    route predictors beside the routers and the engine's routing by them (Predictive Routing Replay)

Trace layout. A `RoutingTrace` holds `experts: [L, B, S, K]` (MoE layer, batch row, token position, top-k slot),
laid out exactly like the token ids of the batch it was recorded on (left padding included). Positions without a
recorded route carry the sentinel `NO_ROUTE = -1`, never a valid expert id: padding (attention mask 0), and in a
trace recorded across `generate` the last sampled token, which is never fed back through the model.

Families. Two router families route differently from the same logits z (`families.route`): the softmax family
(Qwen2/3-MoE, OLMoE, Mixtral) ranks p = softmax(z) and gates with p at the top-k, renormalised when the family does;
the sigmoid family (DeepSeek-V3, GLM-4.5: transformers 5.24 `DeepseekV3TopkRouter`, `Glm4MoeTopkRouter`) ranks s + b,
s = sigmoid(z) and b a per-expert selection bias (`e_score_correction_bias`, moved by load balancing, not by
gradient), within the best `topk_group` of `n_group` expert groups, and gates with s alone at the top-k,
renormalised, times `routed_scaling_factor`: the bias changes which experts are chosen, never their gate weights.
`selection_scores` is what the top-k ranks, `gate_scores` what the gates are taken from.

Gates. `record_routing(..., gates=True)` also records, per chosen expert, the gate weight the router gave it
(`RoutingTrace.weights`, as the family computes it: renormalised or not, in the router's dtype, stored in fp32) and
the router's log-score of it (`RoutingTrace.logprobs`: the log-softmax over all experts, or log sigmoid(z) for the
sigmoid family, whose experts are scored independently).

Replay (GSPO paper §5.3, "Routing Replay"; R3 paper arXiv 2510.11370). By default only the expert *indices* are
replayed (`ReplayRule`); the gate weights are gathered from the *current* router's gate scores at the replayed
experts as the model family computes them, so the router still receives gradient. Another `ReplayRule` decides
otherwise per router call (the routing variants of `algos.routing_variants`: the recorded gate weights too, or only
the replayed experts the current router still ranks high). Positions marked `NO_ROUTE` keep the router's own
choice: they are padding (masked out of attention) or the last token of a sequence, whose hidden state feeds no
scored log-probability. The router's own top-k is still computed during a replayed forward and exposed as
`Replaying.router_choice`, so drift against the replayed routing costs no extra forward; with `score_replayed=True` the
current router's log-probabilities of the trace's experts come back too (`Replaying.replayed_logprobs`). Replay data is
keyed by router module, not by call count, so it holds when activation checkpointing re-runs a layer in backward —
as long as backward runs inside the `replay_routing` context.

Margins. `measures.topk_margin` is the scale-free distance of each token from the top-k cut on its selection
scores, (s[k−1] − s[k]) / (s[0] − s[2k−1]) over its 2k highest (colibri issue #119, measured on Qwen3.6-35B-A3B and
GLM-5.2: the two anchors, `MARGIN_ANCHORS`); `MarginSummary` its median, mean and share below `SMALL_MARGIN`;
`top_gap_share` how much of the same spread the best expert's lead takes (what makes a softmax router's margin
small). The load-balancing losses live beside the router switches that train with them (`algos.routers.balancing`).
"""
