# A script written for vLLM's offline API, in the style of vLLM's examples/offline_inference (basic, chat,
# logprobs). Only the import line differs from what runs under vLLM: `from vllm import LLM, SamplingParams`.
# tests/engine/test_vllm_script.py runs it as a process, with "Qwen/Qwen3-0.6B" in a Hub cache it builds.
from leverlab import LLM, SamplingParams

# Sample prompts.
prompts = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]
# Create a sampling params object.
sampling_params = SamplingParams(temperature=0.8, top_p=0.95)


def print_outputs(outputs):
    print("\nGenerated Outputs:\n" + "-" * 80)
    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        print(f"Prompt: {prompt!r}")
        print(f"Generated text: {generated_text!r}")
        print("-" * 80)


def main():
    # Create an LLM.
    llm = LLM(model="Qwen/Qwen3-0.6B", max_model_len=512, enforce_eager=True, seed=0)

    # basic: generate texts from the prompts; the output is a list of RequestOutput objects
    outputs = llm.generate(prompts, sampling_params)
    print_outputs(outputs)

    # greedy, by keyword
    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    outputs = llm.generate(prompts, sampling_params=greedy, use_tqdm=False)
    print("\nGreedy:")
    for output in outputs:
        print(f"GREEDY {output.outputs[0].token_ids}")

    # chat: one conversation, then a batch of them
    conversation = [
        {"role": "system", "content": "You are a helpful assistant"},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hello! How can I assist you today?"},
        {"role": "user", "content": "Write an essay about the importance of higher education."},
    ]
    outputs = llm.chat(conversation, greedy, use_tqdm=False, chat_template_kwargs={"enable_thinking": False})
    print_outputs(outputs)
    conversations = [conversation for _ in range(3)]
    outputs = llm.chat(conversations, sampling_params=greedy, use_tqdm=True)
    print(f"CHAT BATCH {len(outputs)} {len({o.outputs[0].text for o in outputs})}")

    # logprobs: the top 5 of each generated token and the top 3 of each prompt token
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=5, prompt_logprobs=3)
    outputs = llm.generate(["The capital of France is"], params)
    for output in outputs:
        print(f"PROMPT LOGPROBS FIRST {output.prompt_logprobs[0]}")
        for i, position in enumerate(output.outputs[0].logprobs):
            token_id = output.outputs[0].token_ids[i]
            chosen = position[token_id]
            best = sorted(position.values(), key=lambda lp: lp.rank)
            print(f"TOKEN {token_id} {chosen.decoded_token!r} logprob={chosen.logprob:.4f} rank={chosen.rank} "
                  f"alternatives={len(position)} top={best[0].decoded_token!r}")
        print(f"CUMULATIVE {output.outputs[0].cumulative_logprob:.4f}")
        print(f"REPR {output.outputs[0].logprobs[0]}")


if __name__ == "__main__":
    main()
