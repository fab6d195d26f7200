"""Reading TensorBoard event files back in tests, without TensorBoard itself."""
import struct

from tensorboardX.proto.event_pb2 import Event


def read_events(events_file):
  """The Event records of a TensorBoard event file (TFRecord framing: a little-endian
  uint64 length, its CRC, the record, the record's CRC)."""
  data, offset, events = events_file.read_bytes(), 0, []
  while offset < len(data):
    (length,) = struct.unpack('<Q', data[offset:offset + 8])
    events.append(Event.FromString(data[offset + 12:offset + 12 + length]))
    offset += 12 + length + 4
  return events
