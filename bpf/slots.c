/* Owner module of the slot map and the uplink meter map. They are shared so the XDP module can name them as
 * extern tables, and one function touches them so bcc emits BTF for their value types (bpf_timer and
 * bpf_spin_lock need it). */
#include "slot.h"

BPF_TABLE_SHARED("array", u32, struct ns_slot, NS_SLOT_MAP, NS_SLOTS);
BPF_TABLE_SHARED("array", u32, struct ns_meter, NS_METER_MAP, NS_METER_ENTRIES);

int ns_slots_btf_anchor(struct xdp_md *ctx)
{
    u32 key = 0;
    struct ns_slot *slot = NS_SLOT_MAP.lookup(&key);
    struct ns_meter *meter = NS_METER_MAP.lookup(&key);
    return slot && meter ? XDP_PASS : XDP_ABORTED;
}
