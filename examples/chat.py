"""Chat with the default model: `LLM.chat` applies the model's chat template."""

from jaxpaged import LLM, SamplingParams

llm = LLM()
conversation = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "What is the capital of France?"},
]
outputs = llm.chat(conversation, SamplingParams(temperature=0, max_tokens=64))
reply = outputs[0].outputs[0].text
print(f"Assistant: {reply}")

conversation += [{"role": "assistant", "content": reply},
                 {"role": "user", "content": "And what river flows through it?"}]
outputs = llm.chat(conversation, SamplingParams(temperature=0, max_tokens=64))
print(f"Assistant: {outputs[0].outputs[0].text}")
