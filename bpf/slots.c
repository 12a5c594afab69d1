/* Owner module of the slot map. It is shared so the XDP module can name it as an extern table, and one
 * function touches it so bcc emits BTF for the value type (bpf_timer and bpf_spin_lock need it). */
#include "slot.h"

BPF_TABLE_SHARED("array", u32, struct ns_slot, NS_SLOT_MAP, NS_SLOTS);

int ns_slots_btf_anchor(struct xdp_md *ctx)
{
    u32 key = 0;
    struct ns_slot *slot = NS_SLOT_MAP.lookup(&key);
    return slot ? XDP_PASS : XDP_ABORTED;
}
