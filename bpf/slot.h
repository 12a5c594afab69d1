/* One aggregation slot of the LAN edge data plane (see netstorm/lan/header.py for the packet it aggregates).
 * NS_LANES and NS_SLOTS come from the loader as -D flags; it also replaces the
 * token NS_SLOT_MAP by a per-instance name (bcc's shared tables are process-global). */
#ifndef NS_SLOT_H
#define NS_SLOT_H

#include <linux/bpf.h>

struct ns_slot {
    /* First, at offset 0: clang under bcc 0.26 computes &slot->timer 8 bytes past offsetof() in functions
     * whose slot pointer does not come from a map lookup (the callback); at offset 0 both agree. */
    struct bpf_timer timer;     /* armed by the first packet, cancelled on completion */
    struct bpf_spin_lock lock;  /* guards every field below */
    u32 iteration;
    u32 tensor;
    u32 chunk;
    u16 count;
    s8 scale;
    s8 need;                    /* min over contributors of the largest scale their values fit */
    u8 flags;                   /* NS_FLAG_OVERFLOW once any lane sum left int32 */
    u8 nacks;                   /* timer expiries reported for this key */
    u8 busy;                    /* 1 from the first packet of a key until it completes */
    u8 gap;                     /* 1 once a later chunk completed while this key was still open (reported) */
    u32 index;                  /* this slot's own key, for the timer callback's report */
    u32 pad2;
    u64 bitmap;                 /* contributors seen for this key */
    s32 lanes[NS_LANES];        /* running fixed-point sum */
};

/* One worker's DATA in one iteration, as the program saw it arrive (the agent reads it to time the worker's
 * uplink, bpf/uplinks.py): its first cfg.meter_packets datagrams, a pool's worth, which the worker sends
 * back to back before its first ACK wait. NS_METER_MAP holds one per worker and iteration of a window. */
struct ns_meter {
    struct bpf_spin_lock lock;  /* guards every field below */
    u32 iteration;
    u32 packets;                /* datagrams counted (at most cfg.meter_packets) */
    u32 pad;
    u64 bytes;                  /* their UDP payload bytes, as sent (narrow lanes before widening) */
    u64 first_ns;               /* earliest and latest arrival (bpf_ktime_get_ns: CLOCK_MONOTONIC) */
    u64 last_ns;
};

#endif
