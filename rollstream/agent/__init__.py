"""The agent loop of the run stage: multi-turn model/tool episodes in token ids, with the
LLM session that routes each turn through the balancer."""

from rollstream.agent.episode import run_agent
from rollstream.agent.session import LLMSession
from rollstream.agent.tools import CallToolAdapter, FunctionToolBox, ToolBox, ToolOutput
from rollstream.episode_settings import AgentSettings

__all__ = ["AgentSettings", "CallToolAdapter", "FunctionToolBox", "LLMSession", "ToolBox", "ToolOutput", "run_agent"]
