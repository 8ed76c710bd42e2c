import time, sys
T0 = time.time()
import torch
from tests.harness import run_ranks

def timed(rank, world, name):
    t = {"start": time.time() - T0}
    import transformers
    import tests.test_real_models as trm
    import plait
    t["import"] = time.time() - T0
    case = trm.make(name)
    model = plait.Model(case.net, config=plait.Config(num_stages=world, num_microbatches=3), optimizer=trm._sgd(case.net.parameters()), loss=case.loss)
    t["model"] = time.time() - T0
    model.build(trm._rows(case.x, 0, 6)); t["build"] = time.time() - T0
    model.train_on_batch(trm._rows(case.x, 0, 6), case.y[:6]); t["step1"] = time.time() - T0
    model.train_on_batch(trm._rows(case.x, 0, 6), case.y[:6]); t["step2"] = time.time() - T0
    model.predict(case.x, batch_size=6); t["predict"] = time.time() - T0
    model.state_dict(); t["state"] = time.time() - T0
    return t

if __name__ == "__main__":
    t = time.time()
    res = run_ranks(int(sys.argv[2]), timed, sys.argv[1], timeout=300)
    for r in res: print({k: round(v, 1) for k, v in r.items()})
    print("total", time.time() - t)
