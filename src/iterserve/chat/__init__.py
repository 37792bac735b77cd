"""Chat conversations and tool calls, shared by the server and the offline LLM.chat: the
message shape, the tool plan (which tools a template gets, what `tool_choice` forces), the
rendering of tools into a prompt, and the parsers that read a model's answer into calls."""
