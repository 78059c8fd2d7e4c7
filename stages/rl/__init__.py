"""The RL math and the policy update: pure functions over arrays/tensors (advantages, filters, losses,
logprobs) and the trainer built on them. Nothing here reads or writes run tables; the stages do that."""
