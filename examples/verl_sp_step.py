"""verl's own SFT step with Ulysses SP (FSDP2 over the world, sp = world size / dp), and a user's loss."""
from sp_harness.cases.frameworks.verl import VerlSFTSetup, verl_sft_case


def token_mean_loss():  # built on the rank: verl is imported there only
    from verl.workers.utils.losses import sft_loss

    def loss(model_output, data, dp_group=None):  # verl's engine calls it per micro-batch
        return sft_loss(None, model_output, data, dp_group)  # sum / DP tokens x dp_size

    return loss


SFT = verl_sft_case("my-verl-sft")
QWEN2 = verl_sft_case("my-verl-sft-qwen2", VerlSFTSetup(model="qwen2", loss_function=token_mean_loss))
