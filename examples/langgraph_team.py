#!/usr/bin/env python3
"""A three-agent LangGraph team (researcher -> writer -> reviewer) talking to
`qkvshare serve` through its OpenAI-compatible API, unmodified: langgraph +
langchain-openai from PyPI, nothing QKVSHARE-specific in the agents.

The agents share one message list, the usual LangGraph shape: each call sends
the whole conversation so far plus its own instruction, so every agent's
prompt starts with the previous agent's prompt and reply. The server sees
that prefix in its reuse index and continues the previous agent's KV instead
of prefilling it again; the script prints each agent's prompt and cached
tokens (usage.prompt_tokens_details.cached_tokens) as JSON lines.

    build/src/cli/qkvshare serve -m ~/.cache/qkvshare/models/SmolLM2-135M-Instruct.Q4_1.gguf --port 8080 &
    .venv/bin/python examples/langgraph_team.py --base-url http://127.0.0.1:8080/v1
"""
import argparse
import json
import operator
from typing import Annotated, TypedDict

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph

ROLES = [
    ("researcher", "List three key facts about the topic, one line each."),
    ("writer", "Using the facts above, write a short paragraph for a general reader."),
    ("reviewer", "Review the paragraph above: name one strength and one improvement."),
]


class TeamState(TypedDict):
    messages: Annotated[list[BaseMessage], operator.add]
    usage: Annotated[list[dict], operator.add]


def make_agent(llm, role, instruction):
    def node(state: TeamState):
        turn = HumanMessage(content=f"{role.capitalize()}: {instruction}")
        reply = llm.invoke([SystemMessage(content="You are a small, careful team of writers.")]
                           + state["messages"] + [turn])
        usage = reply.response_metadata.get("token_usage") or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        record = {"agent": role, "prompt_tokens": usage.get("prompt_tokens", 0), "cached_tokens": cached,
                  "completion_tokens": usage.get("completion_tokens", 0), "reply": reply.content}
        return {"messages": [turn, AIMessage(content=reply.content, name=role)], "usage": [record]}
    return node


def build_graph(llm):
    g = StateGraph(TeamState)
    for role, instruction in ROLES:
        g.add_node(role, make_agent(llm, role, instruction))
    g.add_edge(START, ROLES[0][0])
    for (a, _), (b, _) in zip(ROLES, ROLES[1:]):
        g.add_edge(a, b)
    g.add_edge(ROLES[-1][0], END)
    return g.compile()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8080/v1")
    ap.add_argument("--api-key", default="none")
    ap.add_argument("--model", default=None, help="model id (default: the first of /v1/models)")
    ap.add_argument("--topic", default="Why the sky is blue")
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args()
    model = args.model
    if model is None:
        import openai
        model = openai.OpenAI(base_url=args.base_url, api_key=args.api_key).models.list().data[0].id
    llm = ChatOpenAI(base_url=args.base_url, api_key=args.api_key, model=model, temperature=0,
                     max_tokens=args.max_tokens, max_retries=0, timeout=300)
    result = build_graph(llm).invoke({"messages": [HumanMessage(content=f"Topic: {args.topic}")], "usage": []})
    for record in result["usage"]:
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
