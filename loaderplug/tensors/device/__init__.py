"""Where a load's tensors go (decided once per load), and the sink that copies them
from pinned buffers into device memory."""
