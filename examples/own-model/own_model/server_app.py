"""The ServerApp: fl-geo's Di-PS strategy on the user's own model, in under 20 lines of code."""

from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from fl_geo.clients.settings import ClientSection
from fl_geo.strategies import DiPS
from own_model.task import heldout_text, loss_on, make_model

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    heldout = heldout_text()

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        model = make_model()
        model.load_state_dict(arrays.to_torch_state_dict())
        return MetricRecord({"loss": loss_on(model, heldout)})

    inner = ClientSection(lr=float(cfg["inner-lr"]), batch_size=int(cfg["batch-size"]),
                          seq_len=int(cfg["seq-len"]), warmup_steps=5)  # the sites' inner loop
    strategy = DiPS(inner_steps=int(cfg["inner-steps"]), warmup=2, inner=inner)
    result = strategy.start(grid, ArrayRecord(make_model().state_dict()),
                            num_rounds=int(cfg["num-server-rounds"]), evaluate_fn=evaluate)
    losses = result.evaluate_metrics_serverapp
    print(f"own-model: held-out loss {losses[0]['loss']:.3f} -> {losses[max(losses)]['loss']:.3f} "
          f"after {strategy.stats.outer_steps} Di-PS steps, {strategy.stats.rejected} rejected", flush=True)
