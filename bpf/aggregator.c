/* XDP aggregation of LAN workers' fixed-point gradients at the DC gateway.
 *
 * A DATA packet for (iteration, tensor, chunk) is added into its slot under the slot's bpf_spin_lock, so
 * packets of one slot arriving on several receive queues (CPUs) at once serialise per slot while other
 * slots proceed in parallel. Duplicates (bit already in the bitmap) are dropped. The packet that completes
 * the expected contributor mask is rewritten into the aggregate (kind AGG) and passed up to the agent's
 * UDP socket; every other DATA packet is consumed here. The first packet of a key arms the slot's
 * bpf_timer; on expiry the callback reports the slot and its bitmap through the ring buffer (it cannot
 * send packets) and re-arms itself up to max_nacks times, so the agent NACKs the missing workers.
 *
 * The datagram header (struct ns_hdr) and the NS_MAGIC, NS_VERSION, NS_KIND_*, NS_FLAG_* and NS_MAX_WORKERS
 * constants are not written here: the loader puts the text netstorm/lan/header.py generates from its
 * field table (c_definitions) in front of this file, so Python and C share one definition of the layout.
 *
 * Authentication (cfg.auth, when the job has a secret): a DATA packet must carry the token the agent
 * installed for its (worker, iteration) in ns_tokens (NS_TOKEN_WINDOW iterations per worker, indexed by
 * iteration modulo the window); anything else is dropped before it touches a slot and counted as
 * ST_BAD_TOKEN. No cryptography runs here: the agent derives the tokens. AGG is made only by this program,
 * so an AGG arriving from the wire is dropped the same way, and the aggregate this program passes up
 * carries cfg.agg_token, a value only the agent knows, in place of the completing worker's token.
 *
 * Defined by the loader: NS_LANES, NS_SLOTS, NS_RING_PAGES (room for a report from every slot), NS_SLOT_MAP
 * (replaced by the shared table's name), NS_TOKEN_WINDOW (a power of two), NS_KIND_TIMER_INIT (a loader-only kind: initialise one slot's
 * timer, see prime_timers), TIMER_MAP_FD, TIMER_CB_MARK (64-bit constant the loader turns into a
 * BPF_PSEUDO_FUNC reference to ns_timer_cb). */
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/udp.h>
#include "slot.h"

#define NS_CLOCK_MONOTONIC 1

enum ns_stat {
    ST_RX, ST_DUP, ST_COMPLETE, ST_STALE, ST_COLLISION, ST_BAD, ST_UNEXPECTED, ST_OVERFLOW, ST_REEMIT,
    ST_TIMER_EVENTS, ST_BUSY_EVICTED, ST_TIMER_FAIL, ST_REPORT_LOST, ST_BAD_TOKEN, NS_NSTATS
};

struct ns_cfg {
    u64 expected;               /* contributor mask installed by the agent */
    u64 timeout_ns;             /* slot timer period */
    u16 job;
    u16 port;                   /* gateway UDP port, host order */
    u8 max_nacks;               /* timer expiries reported per key before the slot gives up */
    u8 auth;                    /* 1: DATA must carry the token installed for its worker and iteration */
    u8 pad[2];
    u64 agg_token;              /* written into every aggregate passed up (the agent checks it) */
};

struct ns_token {
    u32 iteration;
    u32 pad;
    u64 token;                  /* never 0 when installed: an empty entry matches nothing */
};

struct ns_event {
    u32 iteration;
    u32 tensor;
    u32 chunk;
    u32 slot;
    u64 bitmap;
    u64 expected;
    u16 job;
    u8 scale;                   /* the slot's s8 scale, as a byte */
    u8 nacks;
    u32 pad;
};

BPF_TABLE("extern", u32, struct ns_slot, NS_SLOT_MAP, NS_SLOTS);
BPF_ARRAY(ns_cfg, struct ns_cfg, 1);
BPF_ARRAY(ns_tokens, struct ns_token, NS_MAX_WORKERS * NS_TOKEN_WINDOW);
BPF_PERCPU_ARRAY(ns_stats, u64, NS_NSTATS);
BPF_RINGBUF_OUTPUT(ns_events, NS_RING_PAGES);

static __always_inline void bump(u32 index)
{
    u64 *value = ns_stats.lookup(&index);
    if (value)
        *value += 1;
}

/* Timer callback: the kernel calls it with (map, key, value); bcc would rewrite a three-parameter
 * function as a kprobe, so it takes one parameter and reads the value pointer from r3. */
int ns_timer_cb(void *map)
{
    struct ns_slot *slot;
    asm volatile("%0 = r3" : "=r"(slot));
    u32 zero = 0;
    struct ns_cfg *cfg = ns_cfg.lookup(&zero);
    if (!cfg)
        return 0;
    u64 expected = cfg->expected;
    struct ns_event ev = {};
    int report = 0, rearm = 0;
    bpf_spin_lock(&slot->lock);
    if (slot->busy && slot->bitmap != expected && slot->nacks < cfg->max_nacks) {
        slot->nacks += 1;
        report = 1;
        rearm = slot->nacks < cfg->max_nacks;
        ev.iteration = slot->iteration;
        ev.tensor = slot->tensor;
        ev.chunk = slot->chunk;
        ev.slot = slot->index;
        ev.bitmap = slot->bitmap;
        ev.scale = slot->scale;
        ev.nacks = slot->nacks;
    }
    bpf_spin_unlock(&slot->lock);
    if (report) {
        ev.expected = expected;
        ev.job = cfg->job;
        if (ns_events.ringbuf_output(&ev, sizeof(ev), 0)) {
            /* ring full (the agent is behind): the report is lost, so it must not use up one of the slot's
             * max_nacks reports; the timer tries again next period */
            bump(ST_REPORT_LOST);
            bpf_spin_lock(&slot->lock);
            if (slot->busy && slot->iteration == ev.iteration && slot->nacks == ev.nacks)
                slot->nacks -= 1;
            bpf_spin_unlock(&slot->lock);
            rearm = 1;
        } else {
            bump(ST_TIMER_EVENTS);
        }
        if (rearm)
            bpf_timer_start(&slot->timer, cfg->timeout_ns, 0);
    }
    return 0;
}

int ns_aggregate(struct xdp_md *ctx)
{
    void *data = (void *)(long)ctx->data;
    void *end = (void *)(long)ctx->data_end;
    struct ethhdr *eth = data;
    if ((void *)(eth + 1) > end || eth->h_proto != htons(ETH_P_IP))
        return XDP_PASS;
    struct iphdr *ip = (void *)(eth + 1);
    if ((void *)(ip + 1) > end || ip->protocol != IPPROTO_UDP || ip->ihl != 5 || (ip->frag_off & htons(0x3fff)))
        return XDP_PASS;
    struct udphdr *udp = (void *)(ip + 1);
    if ((void *)(udp + 1) > end)
        return XDP_PASS;
    u32 zero = 0;
    struct ns_cfg *cfg = ns_cfg.lookup(&zero);
    if (!cfg || udp->dest != htons(cfg->port))
        return XDP_PASS;
    struct ns_hdr *h = (void *)(udp + 1);
    if ((void *)(h + 1) > end)
        return XDP_PASS;
    if (h->magic == NS_MAGIC && h->version == NS_VERSION && h->kind == NS_KIND_TIMER_INIT) {
        /* bpf_timer_init allocates; in NAPI context that can fail under load, so the loader initialises
         * every slot's timer up front through BPF_PROG_TEST_RUN and the data path only (re)starts it. */
        u32 index = h->slot;
        struct ns_slot *slot = NS_SLOT_MAP.lookup(&index);
        if (!slot)
            return XDP_ABORTED;
        long err = bpf_timer_init(&slot->timer, (void *)bpf_pseudo_fd(1, TIMER_MAP_FD), NS_CLOCK_MONOTONIC);
        if (!err || err == -16)
            err = bpf_timer_set_callback(&slot->timer, (void *)TIMER_CB_MARK);
        h->total = (u32)-err;       /* the loader reads the errno back from the frame's total */
        return err ? XDP_ABORTED : XDP_DROP;
    }
    if (cfg->auth && h->magic == NS_MAGIC && h->kind == NS_KIND_AGG) {
        bump(ST_BAD_TOKEN);         /* only this program makes aggregates: one from the wire is forged */
        return XDP_DROP;
    }
    /* Anything but our job's DATA goes to the agent, which answers malformed input with a clear error. */
    if (h->magic != NS_MAGIC || h->version != NS_VERSION || h->kind != NS_KIND_DATA || h->job != cfg->job)
        return XDP_PASS;
    bump(ST_RX);
    u32 count = h->count;
    u32 worker = h->worker;
    /* DATA always carries NS_LANES lanes (zero beyond count): fixed-trip loops keep the verifier linear. */
    s32 *in = (s32 *)(h + 1);
    if (count == 0 || count > NS_LANES || worker >= NS_MAX_WORKERS || (h->flags & ~NS_FLAG_OVERFLOW) ||
        (void *)(in + NS_LANES) > end) {
        bump(ST_BAD);
        return XDP_PASS;
    }
    if (cfg->auth) {
        u32 at = worker * NS_TOKEN_WINDOW + (h->iteration & (NS_TOKEN_WINDOW - 1));
        struct ns_token *want = ns_tokens.lookup(&at);
        u64 got = h->token;
        if (!want || !want->token || want->iteration != h->iteration || want->token != got) {
            bump(ST_BAD_TOKEN);
            return XDP_DROP;
        }
    }
    u64 bit = 1ULL << worker;
    u64 expected = cfg->expected;
    if (!(expected & bit)) {
        bump(ST_UNEXPECTED);
        return XDP_DROP;
    }
    u32 index = h->slot;
    struct ns_slot *slot = NS_SLOT_MAP.lookup(&index);
    if (!slot) {
        bump(ST_BAD);
        return XDP_PASS;
    }
    u32 iteration = h->iteration, tensor = h->tensor, chunk = h->chunk;
    s8 scale = h->scale;
    int first = 0, last = 0, stat = -1;
    u64 ovf = 0;

    bpf_spin_lock(&slot->lock);
    int same = slot->iteration == iteration && slot->tensor == tensor && slot->chunk == chunk;
    s32 age = (s32)(iteration - slot->iteration);
    if (same && scale == slot->scale && slot->bitmap) {
        if (count != slot->count) {
            stat = ST_BAD;
        } else if (slot->bitmap & bit) {
            if (slot->busy) {
                stat = ST_DUP;
            } else {
                last = 1;           /* a retransmission after completion: hand the aggregate up again */
                stat = ST_REEMIT;
            }
        } else {
            for (u32 i = 0; i < NS_LANES; i++) {
                s64 sum = (s64)slot->lanes[i] + (s64)in[i];
                ovf |= (u64)(sum + 0x80000000LL) >> 32;
                slot->lanes[i] = (s32)sum;
            }
            slot->bitmap |= bit;
            slot->flags |= (h->flags & NS_FLAG_OVERFLOW) | (ovf ? NS_FLAG_OVERFLOW : 0);
            if (h->need < slot->need)
                slot->need = h->need;
            if (slot->bitmap == expected) {
                slot->busy = 0;
                last = 1;
                stat = ST_COMPLETE;
            }
        }
    } else if ((same && scale < slot->scale) || age > 0 || !slot->bitmap) {
        if (slot->busy && !same)
            stat = ST_BUSY_EVICTED;     /* a newer iteration took over a slot that never completed */
        slot->iteration = iteration;
        slot->tensor = tensor;
        slot->chunk = chunk;
        slot->index = index;
        slot->scale = scale;
        slot->count = count;
        slot->need = h->need;
        slot->flags = h->flags & NS_FLAG_OVERFLOW;
        slot->nacks = 0;
        slot->bitmap = bit;
        for (u32 i = 0; i < NS_LANES; i++) {
            slot->lanes[i] = in[i];
        }
        first = 1;
        if (bit == expected) {
            slot->busy = 0;
            last = 1;
            stat = ST_COMPLETE;
        } else {
            slot->busy = 1;
        }
    } else {
        stat = same ? ST_STALE : (age == 0 ? ST_COLLISION : ST_STALE);
    }
    if (last) {
        for (u32 i = 0; i < NS_LANES; i++) {
            in[i] = slot->lanes[i];
        }
        h->kind = NS_KIND_AGG;
        h->flags = slot->flags;
        h->need = slot->need;
    }
    bpf_spin_unlock(&slot->lock);

    if (stat >= 0)
        bump(stat);
    if (ovf)
        bump(ST_OVERFLOW);
    if (first && !last) {
        /* -EBUSY once the slot's timer is initialised: harmless, the callback stays the same. */
        long err = bpf_timer_init(&slot->timer, (void *)bpf_pseudo_fd(1, TIMER_MAP_FD), NS_CLOCK_MONOTONIC);
        if (err && err != -16 /* EBUSY: initialised before */)
            bump(ST_TIMER_FAIL);
        if (bpf_timer_set_callback(&slot->timer, (void *)TIMER_CB_MARK))
            bump(ST_TIMER_FAIL);
        if (bpf_timer_start(&slot->timer, cfg->timeout_ns, 0))
            bump(ST_TIMER_FAIL);
    }
    if (last) {
        h->token = cfg->agg_token;
        if (!first)
            bpf_timer_cancel(&slot->timer);
        udp->check = 0;         /* lanes changed; a zero UDP checksum over IPv4 means "none" */
        return XDP_PASS;
    }
    return stat == ST_BAD ? XDP_PASS : XDP_DROP;
}
