"""How a sample's response is made: one generation, a tool-calling session, or the user's own agent
talking to the policy through an OpenAI-compatible gateway."""
