"""EDM2 diffusion generator (Karras et al., CVPR 2024, "Analyzing and Improving the Training Dynamics of
Diffusion Models"), as described in docs/factory.md, split as the method is:

config.py    the generator's settings (plain, JSON-able data), their validation and the presets
network.py   magnitude-preserving primitives, the UNet and EDM's preconditioning with the logvar head
training.py  the uncertainty-weighted loss, the learning-rate schedule, the power-function EMA and the
             training loop
sampling.py  EDM's deterministic Heun sampler, with optional guidance

Training images enter as numpy arrays (N, C, H, W), float32 in [0, 1] or uint8 0-255
(fedskew.data.pixels); samples leave as float32 in [0, 1]. The network works in [-1, 1]
(sigma_data = 0.5 is stated for that range). The names the rest of fedskew uses are importable from
here; code that patches one (a benchmark, a test) patches it in the module that defines it.
"""

from fedskew.models.edm2.config import (
    CHANNELS_PER_HEAD,
    CPU_PRESET,
    GPU_PRESET_32PX,
    GeneratorConfig,
    attention_heads,
    budgeted_for_class,
    cpu_preset,
    with_batch_for_class_size,
)
from fedskew.models.edm2.network import (
    SIGMA_DATA,
    SILU_RMS,
    Block,
    MPConv,
    MPFourier,
    Precond,
    UNet,
    build_generator,
    count_parameters,
    mp_cat,
    mp_silu,
    mp_sum,
    normalize,
    preconditioning,
    resample,
)
from fedskew.models.edm2.sampling import Guidance, heun_sample, sample, sigma_steps
from fedskew.models.edm2.training import (
    ADAM_BETAS,
    ADAM_EPS,
    PowerFunctionEMA,
    PrivateGradients,
    TrainStats,
    augment,
    autocast_dtype,
    edm2_loss,
    elementwise_loss,
    ema_gamma,
    learning_rate,
    train_generator,
    training_noise,
)
