"""SamplingParams ⇄ `specdec.rpc.v1.SamplingParams` (gateway.proto), for the gateway and the verifier alike.

Unset optional fields take the defaults of specdec.sampling_params; set ones are kept as sent, so an explicit
`top_p = 0` or `max_tokens = 0` reaches validation and is refused instead of meaning "unset".
"""
from __future__ import annotations

from specdec.rpc.v1 import gateway_pb2
from specdec.sampling_params import GrammarSpec, SamplingError, SamplingParams

OPTIONAL = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
            "frequency_penalty", "seed", "logprobs", "speculation", "cache_salt")


def params_from_proto(message: gateway_pb2.SamplingParams) -> SamplingParams:
    """Unvalidated: call .validate(vocab_size) on the result (SamplingError names the bad field)."""
    values = {name: getattr(message, name) for name in OPTIONAL if message.HasField(name)}
    values |= {"stop": list(message.stop), "stop_token_ids": list(message.stop_token_ids),
               "ignore_eos": message.ignore_eos}
    if message.HasField("grammar"):
        values["grammar"] = grammar_from_proto(message.grammar)
    return SamplingParams.from_fields(values)


def grammar_from_proto(message: gateway_pb2.Grammar) -> GrammarSpec:
    kind = message.WhichOneof("kind")
    if kind is None or (kind == "json_object" and not message.json_object):
        raise SamplingError("grammar: set one of json_object (true), json_schema, regex, ebnf, structural_tag")
    return GrammarSpec(kind, "" if kind == "json_object" else getattr(message, kind))


def grammar_to_proto(spec: GrammarSpec, message: gateway_pb2.Grammar) -> None:
    """Write `spec` into `message` (a Grammar field of a message being built)."""
    setattr(message, spec.kind, True if spec.kind == "json_object" else spec.text)


def params_to_proto(params: SamplingParams) -> gateway_pb2.SamplingParams:
    message = gateway_pb2.SamplingParams(stop=list(params.stop), stop_token_ids=list(params.stop_token_ids),
                                         ignore_eos=params.ignore_eos)
    for name in OPTIONAL:
        value = getattr(params, name)
        if value is not None:
            setattr(message, name, value)
    if params.grammar is not None:
        grammar_to_proto(params.grammar, message.grammar)
    return message
