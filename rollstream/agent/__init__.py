"""The agent loop of the run stage: multi-turn model/tool episodes in token ids (episode.py), each
model turn through the job's LLM session (rollstream.llm.session), and the door that harnesses
call in the APIs they speak (gateway.py and the door_* modules). Import from the modules."""
