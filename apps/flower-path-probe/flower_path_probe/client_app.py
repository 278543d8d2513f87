"""ClientApp: send the received array back, every 32-bit word XOR 1.

The flip makes the reply new content. Flower stores message objects by the SHA-256 of their
content (5 MiB chunks for arrays), so a byte-identical echo could be answered by chunks the
SuperLink or SuperNode already hold and would not measure the way back.
"""

from __future__ import annotations

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()


@app.train()
def echo(msg: Message, context: Context) -> Message:
    arr = msg.content["payload"]["x"].numpy()  # a copy we own
    words = arr.view(np.uint32)
    words ^= np.uint32(1)
    return Message(RecordDict({"payload": ArrayRecord({"x": Array(arr)})}), reply_to=msg)
